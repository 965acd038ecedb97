"""Token sequences with loss masks, length-grouped batches, and the LightningDataModule.

``loss_mask[t]`` is True when position t's *next* token x_{t+1} is one the head is trained and measured on
(heads.base's convention). Chat: assistant tokens only. They are found from the tokenizer's own chat template:
every prefix of the conversation is rendered with ``apply_chat_template`` and the character span each assistant
turn adds is mapped to tokens through the fast tokenizer's offsets, so no separator is ever hard-coded and any
template that renders prefixes consistently works. Plain text: every token. Generations: the generated part.

Sequences are right-padded (with an attention mask) rather than packed: packing would let attention cross
documents, and the target features the head sees would then differ from the ones it sees when serving. Batches
group similar lengths so padding stays small. The batch order is a seeded function of (seed, epoch) and is
resumable: the train loader's state (saved in Lightning's checkpoint) says how many batches were consumed.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace
from functools import partial

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from heads import chat
from train import UserError
from train.distill import DistillConfig, answer
from heads.splits import SPLITS
from heads.records import Record, reference_records, split_records

log = logging.getLogger(__name__)


@dataclass
class DataConfig:
    name: str = "default"  # recorded in acceptance.json
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)  # empty: hold out a hashed slice of train_files
    heldout_fraction: float = 0.2
    respond: str = "auto"  # auto: the target answers prompt-only records; target: it answers all; dataset: skip them
    max_len: int = 512
    batch_size: int = 8  # per device
    eval_batch_size: int = 8
    max_train_records: int | None = None
    # Records trained on as written beside train_files: their reference answers, with the target's soft labels at
    # every answer token (EAGLE-1's fixed-dataset recipe); prompt-only records in them are skipped. On SmolLM2 this
    # measured as good per trained token as the target's own answers, at a feature pass instead of a decode loop.
    reference_files: list[str] = field(default_factory=list)
    max_reference_records: int | None = None
    max_eval_records: int | None = None
    # Which records max_train_records and max_reference_records sample. The job's own seed only seeds the head and
    # the batch order, so two seeds of one recipe train on the same text (and reuse its feature cache).
    seed: int = 0
    num_workers: int = 0  # tokenised tensors in memory: workers only add start-up cost
    cache_features: bool = False  # run the target once over the training set and keep the features it reads
    features_on_disk: bool = False  # with cache_features: bf16 memory-mapped shards reused by later runs
    feature_dir: str | None = None  # null: ~/.cache/draftheads/features/<target>-<hash of target, data, layers>
    # The training text's feature pass: "target" runs it in the target's dtype; "bf16" under bf16 autocast;
    # "bf16-if-native" only where bf16 is native (a GPU, or a CPU with AMX or AVX512-BF16). The held-out text's
    # features stay in the target's dtype, so mid-run checks measure the features the final α and a runner see.
    feature_precision: str = "target"
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        if self.feature_precision not in ("target", "bf16", "bf16-if-native"):
            raise UserError(f"data.feature_precision={self.feature_precision!r}; choose target, bf16 or "
                            "bf16-if-native")

    @classmethod
    def from_dict(cls, d: dict) -> "DataConfig":
        d = dict(d)
        d["distill"] = DistillConfig(**d.get("distill", {}))
        return cls(**d)


@dataclass
class Example:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool
    hidden: dict[int, torch.Tensor] | None = None  # cached target features k -> [T, H] (cache_features)
    category: str | None = None  # the record's category (Spec-Bench), for α per category
    split: str | None = None  # held-out examples: "validation" or "test" (heads/splits.py)
    key: str | None = None  # held-out examples: the prompt's heads.splits key (acceptance.json's heldout_prompt_keys)


def _mask_from_trained(trained: list[bool]) -> torch.Tensor:
    """trained[j]: token j is a training token -> loss_mask[j-1] (position j-1 predicts it)."""
    mask = torch.zeros(len(trained), dtype=torch.bool)
    mask[:-1] = torch.tensor(trained[1:], dtype=torch.bool)
    return mask


def chat_example(messages: list[dict], tokenizer, max_len: int, where: str = "") -> Example:
    render = partial(chat.render, tokenizer)
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], add_generation_prompt=True), render(messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise UserError(f"{where}: this tokenizer's chat template does not render conversation prefixes "
                            "consistently, so assistant turns cannot be located; use a plain-text data format")
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    trained = [any(a <= s < b for a, b in spans) and e > s for s, e in enc["offset_mapping"][:max_len]]
    return Example(torch.tensor(ids, dtype=torch.long), _mask_from_trained(trained))


def text_example(text: str, tokenizer, max_len: int) -> Example:
    ids = tokenizer(text).input_ids[:max_len]  # the tokenizer's own special tokens (BOS) as the target expects
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[-1] = False  # nothing follows the last token
    return Example(torch.tensor(ids, dtype=torch.long), mask)


def ids_example(prompt_ids: list[int], token_ids: list[int], max_len: int) -> Example:
    ids = (prompt_ids + token_ids)[:max_len]
    return Example(torch.tensor(ids, dtype=torch.long),
                   _mask_from_trained([j >= len(prompt_ids) for j in range(len(ids))]))


def tokenize(record: Record, tokenizer, max_len: int) -> Example:
    ex = _tokenize(record, tokenizer, max_len)
    ex.category, ex.split = record.category, record.split
    ex.key = record.key() if record.split is not None else None
    return ex


def _tokenize(record: Record, tokenizer, max_len: int) -> Example:
    if record.prompt_ids is not None:
        ex = ids_example(record.prompt_ids, record.token_ids, max_len)
        if record.features is not None:  # features kept while the target generated this very sequence
            ex.hidden = {k: h[:max_len] for k, h in record.features.items()}
        return ex
    if record.messages is not None:
        return chat_example(record.messages, tokenizer, max_len, record.where)
    return text_example(record.text, tokenizer, max_len)


def token_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """[V] how often each token is a *trained* next token: EAGLE-3 keeps the most frequent as its draft vocab."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ex in examples:
        counts += torch.bincount(ex.input_ids[1:][ex.loss_mask[:-1]], minlength=vocab_size)[:vocab_size].double()
    return counts


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(ex.input_ids) for ex in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(examples), T), dtype=torch.bool)
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
    for b, ex in enumerate(examples):  # right padding: real tokens keep positions 0..n-1, as when serving
        n = len(ex.input_ids)
        ids[b, :n], loss_mask[b, :n], attention_mask[b, :n] = ex.input_ids, ex.loss_mask, 1
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
    if examples[0].hidden is not None:
        for k, h in examples[0].hidden.items():
            padded = h.new_zeros((len(examples), T, h.shape[-1]))  # [B, T, H]
            for b, ex in enumerate(examples):
                padded[b, : len(ex.input_ids)] = ex.hidden[k]
            batch[f"hidden.{k}"] = padded
    return batch


class LengthGroupedBatches(Sampler):
    """Seeded, resumable, rank-sharded batches of similar length.

    Each epoch: a (seed, epoch) permutation, cut into windows of 32 batches, each window sorted by length and cut
    into batches, batch order shuffled again; rank r takes batches r, r+W, ... (equal counts on every rank).
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world: int = 1, drop_last: bool = True):
        self.lengths, self.batch_size, self.seed, self.shuffle = lengths, batch_size, seed, shuffle
        self.rank, self.world, self.drop_last = rank, world, drop_last
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        n, B = len(self.lengths), self.batch_size
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: -self.lengths[i])
            batches = [order[i:i + B] for i in range(0, n, B)]
            return batches[self.rank::self.world]
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(n))
        rng.shuffle(order)
        batches = []
        for w in range(0, n, 32 * B):
            window = sorted(order[w:w + 32 * B], key=lambda i: -self.lengths[i])
            batches += [window[i:i + B] for i in range(0, len(window), B)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == B]
        rng.shuffle(batches)
        per_rank = len(batches) // self.world if self.drop_last else -(-len(batches) // self.world)
        return batches[self.rank::self.world][:per_rank]

    def __len__(self) -> int:
        return len(self._batches())

    def resume(self, batches_consumed: int) -> None:
        self.epoch, self.skip = divmod(batches_consumed, len(self))

    def __iter__(self):
        batches = self._batches()
        skip, self.skip = self.skip, 0  # a resumed epoch skips what was already consumed, once
        yield from batches[skip:]


class ResumableLoader(DataLoader):
    """A DataLoader Lightning checkpoints: its state is how many batches training consumed (optimizer steps x
    accumulation, read from the trainer, so batches Lightning prefetched but never trained on do not count)."""

    def __init__(self, *args, consumed=lambda: 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.consumed = consumed

    def state_dict(self) -> dict:
        return {"batches_consumed": self.consumed()}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.resume(int(state["batches_consumed"]))

    def __iter__(self):
        # Each pass starts where training stands: Lightning never calls set_epoch on a batch sampler (it looks for
        # loader.sampler and loader.batch_sampler.sampler only), so epochs would otherwise all repeat epoch 0's
        # order, and a run resumed past an epoch boundary would train other batches than an uninterrupted one.
        self.batch_sampler.resume(self.consumed())
        return super().__iter__()


class DraftDataModule(L.LightningDataModule):
    """Reads, self-distils and tokenises once (``prepare``), then serves batches to Lightning and to evaluation."""

    def __init__(self, cfg: DataConfig, target, seed: int = 0, mode: str = "train"):
        """``seed`` orders the batches; which records are sampled is ``cfg.seed``'s."""
        super().__init__()
        self.cfg, self.target, self.seed, self.mode = cfg, target, seed, mode
        self.train_examples: list[Example] = []  # train_files' text, then reference_files'
        self.reference_examples: list[Example] = []
        self.eval_examples: list[Example] = []  # the validation text of the first evaluation temperature
        self.eval_sets: dict[float, list[Example]] = {}  # temperature -> the held-out text α at it is measured on
        # (both splits: the validation half picks the head and feeds predictions, the test half is only reported)
        self.eval_text: dict[float, str] = {}  # temperature -> which text that is (acceptance.json)
        self.text_costs: list[dict] = []  # what the target's answers trained on cost to write (distill.answer)
        self.feature_cache: dict | None = None  # where the disk feature cache is, its size (features_on_disk)
        self.heldout_keys: dict[str, list[str]] = {}  # split -> the held-out prompts' keys (acceptance.json)

    def prepare(self, layers=(), eval_temperatures=(0.0,), eval_top_p: float = 1.0) -> None:
        """Read, split, self-distil and tokenise. ``layers``: keep these target features while generating.

        α at temperature T is measured on what a runner at T verifies: held-out prompts are answered by the target
        greedily for T = 0 and sampled at T otherwise (held-out records that come with answers keep them).
        """
        c, tok = self.cfg, self.target.tokenizer
        layers = tuple(sorted(set(layers) | {self.target.dims.num_layers})) if c.cache_features and layers else ()
        if c.respond not in ("auto", "target", "dataset"):
            raise UserError(f"data.respond={c.respond!r}; choose auto, target or dataset")
        train_files = c.train_files if self.mode == "train" else []
        if self.mode == "eval" and not c.eval_files:
            train_files = c.train_files  # the held-out slice of the training files
        train, heldout = split_records(train_files, c.eval_files, c.heldout_fraction, c.max_train_records,
                                       c.max_eval_records, c.seed)
        if self.mode == "eval":
            train = []
        self.train_examples = self._examples("train", train, c.distill, layers)
        if c.reference_files and self.mode == "train":  # the same held-out exclusion as train_files
            reference = reference_records(c.reference_files, heldout, c.max_reference_records, c.seed)
            self.reference_examples = self._examples("reference", reference, c.distill, respond="dataset")
            self.train_examples += self.reference_examples
        for t in dict.fromkeys(float(t) for t in eval_temperatures):
            sampling = replace(c.distill, temperature=t, top_p=eval_top_p if t > 0 else 1.0, samples_per_prompt=1)
            self.eval_sets[t] = self._examples(f"eval-t{t:g}", heldout, sampling)
            answered = 0 if c.respond == "dataset" else len(heldout) if c.respond == "target" else \
                sum(r.needs_answer for r in heldout)
            how = "greedy answers" if t == 0 else f"answers sampled at T={t:g}, top_p={sampling.top_p:g}"
            parts = [f"the target's {how} to {answered} held-out prompts"] if answered else []
            if len(heldout) > answered:
                parts.append(f"dataset text of {len(heldout) - answered} held-out records")
            if len(self.eval_sets[t]) < len(heldout):
                parts.append(f"α on the {len(self.eval_sets[t])} with answer tokens inside data.max_len={c.max_len}")
            self.eval_text[t] = "; ".join(parts)
        main = next(iter(self.eval_sets.values()), [])
        # the prompts α is measured on: one whose prompt fills data.max_len has no answer token, no α
        self.heldout_keys = {split: [ex.key for ex in main if ex.split == split] for split in SPLITS}
        self.eval_examples = [ex for ex in main if ex.split == "validation"]
        if self.mode == "train" and not self.train_examples:
            raise UserError("no training data; set data.train_files")
        if not self.eval_examples or len(self.eval_examples) == len(main):
            raise UserError(f"{len(main)} held-out sequences make no validation and test split (at least 2 per "
                            "category are needed); set data.eval_files or raise data.heldout_fraction")
        test = [ex for ex in main if ex.split == "test"]
        log.info("data %s: %d train sequences (%d trained tokens; %d of them reference answers), held out %d "
                 "validation (%d tokens) and %d test (%d tokens)", c.name, len(self.train_examples),
                 self.num_tokens(self.train_examples), len(self.reference_examples), len(self.eval_examples),
                 self.num_tokens(self.eval_examples), len(test), self.num_tokens(test))

    def _examples(self, split: str, records: list[Record], sampling, layers=(), respond: str | None = None
                  ) -> list[Example]:
        c = self.cfg
        if (respond or c.respond) == "dataset":
            records = [r for r in records if not r.needs_answer]
        else:
            records = answer(records, self.target, sampling, force=c.respond == "target", split=split, layers=layers,
                             costs=self.text_costs if split == "train" else None)
        kept = [ex for ex in (tokenize(r, self.target.tokenizer, c.max_len) for r in records) if ex.loss_mask.any()]
        if records and not kept:
            raise UserError(f"no {split} tokens to learn from in {len(records)} records (first: {records[0].where})"
                            f"; chat data needs assistant turns, or raise data.max_len={c.max_len}")
        return kept

    @torch.no_grad()
    def cache_features(self, layers) -> None:
        """EAGLE-style offline features: one target pass over the training set instead of one per epoch.

        Keeps the hidden states the head reads (and the final-norm output, from which the module recomputes the
        target's logits with the lm_head: far cheaper than the decoder stack and far smaller than [T, V] logits).
        The held-out text of the main evaluation temperature is cached alike, so a mid-run α check (val/alpha@k)
        is a head pass over it; the final acceptance measurement still runs the target itself.
        """
        from train.feature_cache import attach, pass_autocast

        layers = sorted(set(layers) | {self.target.dims.num_layers})
        autocast = pass_autocast(self.cfg.feature_precision, self.target)
        if self.cfg.features_on_disk:
            root = self.cfg.feature_dir  # an explicit directory holds one key: the held-out text gets a subfolder
            self.feature_cache = attach(self.target, self.train_examples, layers, self.cfg.max_len, root,
                                        batch_size=self.cfg.eval_batch_size, autocast=autocast)
            self.feature_cache["heldout"] = attach(self.target, self.eval_examples, layers, self.cfg.max_len,
                                                   f"{root}/heldout" if root else None,
                                                   batch_size=self.cfg.eval_batch_size)
            return
        self._cache_in_memory(self.train_examples, layers, autocast)
        self._cache_in_memory(self.eval_examples, layers)

    def _cache_in_memory(self, examples: list[Example], layers: list[int], autocast: torch.dtype | None = None
                         ) -> None:
        """The same length-sorted batches as the evaluation loaders: the held-out features equal the online ones."""
        device = next(self.target.model.parameters()).device
        loader = self._loader(examples, LengthGroupedBatches(
            [len(ex.input_ids) for ex in examples], self.cfg.eval_batch_size, shuffle=False, drop_last=False))
        order = loader.batch_sampler._batches()
        for idx, batch in zip(order, loader):
            if all(examples[i].hidden is not None for i in idx):
                continue  # kept from generation
            attn = None if bool(batch["attention_mask"].all()) else batch["attention_mask"].to(device)
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                hidden = self.target.hidden_states(batch["input_ids"].to(device), attn, layers)
            for b, i in enumerate(idx):
                n = len(examples[i].input_ids)
                examples[i].hidden = {k: hidden[k][b, :n].cpu() for k in layers}

    @staticmethod
    def num_tokens(examples: list[Example]) -> int:
        return int(sum(ex.loss_mask.sum() for ex in examples))

    def token_counts(self) -> torch.Tensor:
        return token_counts(self.train_examples, self.target.dims.vocab_size)

    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _loader(self, examples, batches: LengthGroupedBatches) -> DataLoader:
        return DataLoader(examples, batch_sampler=batches, num_workers=self.cfg.num_workers,
                          collate_fn=partial(collate, pad_id=self.target.tokenizer.pad_token_id))

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        lengths = [len(ex.input_ids) for ex in self.train_examples]
        batches = LengthGroupedBatches(lengths, self.cfg.batch_size, self.seed, True, rank, world)
        if len(batches) == 0:
            raise UserError(f"{len(lengths)} training sequences make no full batch of data.batch_size="
                            f"{self.cfg.batch_size} on {world} device(s); lower data.batch_size or add data")
        t = self.trainer
        return ResumableLoader(self.train_examples, batch_sampler=batches, num_workers=self.cfg.num_workers,
                               collate_fn=partial(collate, pad_id=self.target.tokenizer.pad_token_id),
                               consumed=lambda: t.global_step * t.accumulate_grad_batches if t is not None else 0)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        lengths = [len(ex.input_ids) for ex in self.eval_examples]
        if len(lengths) < world:
            raise UserError(f"{len(lengths)} validation sequences cannot give each of {world} ranks one; add held-out "
                            "data (data.eval_files, data.max_eval_records) or use fewer devices")
        # smaller batches where the validation split is short, so that no rank is left with an empty loader
        batch_size = min(self.cfg.eval_batch_size, len(lengths) // world)
        return self._loader(self.eval_examples, LengthGroupedBatches(lengths, batch_size, shuffle=False, rank=rank,
                                                                     world=world, drop_last=False))

    def eval_loader(self, examples: list[Example] | None = None) -> DataLoader:
        """All held-out data in one process, for the final acceptance measurement."""
        examples = self.eval_examples if examples is None else examples
        lengths = [len(ex.input_ids) for ex in examples]
        return self._loader(examples, LengthGroupedBatches(lengths, self.cfg.eval_batch_size, shuffle=False,
                                                           drop_last=False))

    def eval_loaders(self, split: str = "validation") -> dict[float, dict]:
        """{temperature: {category: loader}} over each temperature's own held-out text of one split
        (acceptance.measure_sets)."""
        sets = {}
        for t, examples in self.eval_sets.items():
            examples = [ex for ex in examples if ex.split == split]
            categories = sorted({ex.category for ex in examples}, key=str)
            sets[t] = {cat: self.eval_loader([ex for ex in examples if ex.category == cat]) for cat in categories}
        return sets
