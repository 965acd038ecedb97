"""Train an EAGLE-3 head with SafeAILab's reference trainer (``eagle/traineagle3`` from ../shared/clients, its files
unmodified), in the eagle_ref venv (transformers 4.53), for scripts/reference_parity.py. Writes OUT/model.safetensors
(the trained draft layer in SafeAILab's own key names: the ``eagle`` export layout) and OUT/train.json.

What runs as SafeAILab wrote it: ``cnets.Model`` (the target's layers 2, L//2, L-3 through its modeling_llama_kv,
fc, the one decoder layer, its 7-step training-time test and soft cross-entropy, its random lm_head init), the
0.8^k step weights of main.py, its ``scandata`` vocabulary rule (``process_data`` counts of the tokens under the loss
mask, the draft_vocab_size most common, d2t/t2d) and ds_config.json's AdamW (betas 0.9/0.95, no weight decay),
gradient clipping 0.5, micro-batch 1 with 2 accumulation steps and WarmupDecayLR (log warm-up, linear decay).

What is replaced, and why:
- DeepSpeed -> a plain torch AdamW loop on the CPU: DeepSpeed's ZeRO-2 engine needs GPUs; on one process its
  update is AdamW with the same betas, clipping, accumulation (loss / 2) and schedule, all done here explicitly.
- fp16 (ds_config) -> fp32: the target is cast to fp32 after cnets' fp16 load, as our trainer runs on a CPU.
- The loss mask: main.py splits on Llama-3 separators (``<|eot_id|><|start_header_id|>...``), which SmolLM2's
  chatml never contains. Here the assistant spans are found with chatml's: from ``<|im_start|>assistant\\n`` to
  the end of the next ``<|im_end|>\\n``; ``loss_mask[t]`` marks position t, whose first draft predicts token t+2,
  when that token is an answer token (main.py's mask has the same two-token offset). The caller checks the text
  and the trained tokens are token for token what our trainer trains on, else the run is refused.
- The system prompt: main.py prepends Llama-2's; here the conversation is rendered as SmolLM2's template renders
  it (its default system turn), the same text our trainer reads.
- scandata's tokenising pass (datasets.load_dataset + the Llama-3 mask) -> the mask above, fed to its own
  ``process_data``/``merge_dicts`` and top-N rule, saved as the cache.pt ``scandata`` then loads. The eagle_ref
  venv has no ``datasets``; cnets imports it only for that pass, so a stub stands in when it is missing.
- The draft layer's rotary base: traineagle3/cnets.py builds its LlamaRotaryEmbedding with the default base 10000,
  while SafeAILab's inference cnets.py (and our export's config) use the target's rope_theta (SmolLM2: 100000);
  it is rebuilt with cnets' own class at the target's rope_theta, so the head trains with the rotary it runs with.
- Gradient checkpointing off (main.py asks for it): it saves GPU memory and costs recompute; the maths is equal.
- Data order: main.py's DistributedSampler (seed 0, epoch 1) without the datasets-library shuffle (seed 42) first.
- The lr schedule's step counts are scaled to the run (see ``lr_at``); the caller records it in parity.json.

    python eagle3_ref_train.py CONFIG_JSON      # keys: see ``main``
"""
import hashlib
import json
import math
import os
import platform
import sys
import time
import types
from collections import Counter
from types import SimpleNamespace

import torch

CHATML_ANSWER, CHATML_END = "<|im_start|>assistant\n", "<|im_end|>\n"
REFERENCE_WARMUP, REFERENCE_TOTAL = 12000, 800000  # ds_config.json's WarmupDecayLR step counts


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """DeepSpeed WarmupDecayLR (warmup_type log, warmup_min_lr 0) for optimizer step ``step`` (0-based): the first
    step runs at the initial lr 0, then the scheduler's iteration is step - 1."""
    it = step - 1
    if it < 0:
        return 0.0
    warmup = max(2, warmup)
    if it < warmup:
        return peak * math.log(it + 1) / math.log(warmup)
    return peak * max(0.0, (total - it) / max(1.0, total - warmup))


def chatml_trained(conversation: str, ids: list, tokenizer) -> list:
    """trained[j]: token j is in an assistant turn (its text, <|im_end|> and the newline after it)."""
    count = lambda end: len(tokenizer(conversation[:end], add_special_tokens=False).input_ids)  # noqa: E731
    trained = [False] * len(ids)
    start = conversation.find(CHATML_ANSWER)
    while start >= 0:
        a = start + len(CHATML_ANSWER)
        close = conversation.find(CHATML_END, a)
        b = len(conversation) if close < 0 else close + len(CHATML_END)
        for j in range(count(a), count(b)):
            trained[j] = True
        start = conversation.find(CHATML_ANSWER, b)
    return trained


def sequence_digest(h, ids: list, trained: list) -> None:
    """The parity harness's text identity: ids (int64) and trained flags (uint8), sequence by sequence."""
    h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    h.update(torch.tensor(trained, dtype=torch.uint8).numpy().tobytes())
    h.update(b"|")


def examples(records: list, tokenizer, max_len: int) -> tuple[list, str]:
    out, h = [], hashlib.sha256()
    for r in records:
        conversation = tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=False)
        ids = tokenizer(conversation, add_special_tokens=False).input_ids
        if len(ids) > max_len:  # main.py drops such records; the caller selects none, so the texts stay equal
            raise SystemExit(f"error: record {r.get('id')} has {len(ids)} tokens > max_len {max_len}")
        trained = chatml_trained(conversation, ids, tokenizer)
        sequence_digest(h, ids, trained)
        mask = trained[2:] + [False, False]  # loss_mask[t]: token t+2, the first draft's prediction, is trained
        out.append((torch.tensor([ids]), torch.tensor([mask], dtype=torch.long)))
    return out, h.hexdigest()


def vocabulary_cache(cnets, data: list, n: int, vocab_size: int) -> None:
    """scandata's top-N rule over its own process_data counts, written to the cache.pt scandata then loads."""
    chunk = {"input_ids": [[ids[0].tolist()] for ids, _ in data], "loss_mask": [[m[0].tolist()] for _, m in data]}
    token_dict = cnets.merge_dicts([cnets.process_data(chunk)])
    if len(token_dict) < n:
        raise SystemExit(f"error: the training text has {len(token_dict)} distinct trained tokens, fewer than the "
                         f"draft vocabulary {n}; lower the draft vocabulary or raise the token count")
    used_tokens = sorted(key for key, _ in token_dict.most_common(n))  # as cnets.scandata
    d2t = torch.tensor([used_tokens[i] - i for i in range(len(used_tokens))])
    t2d = torch.tensor([i in set(used_tokens) for i in range(vocab_size)])
    torch.save({"d2t": d2t, "t2d": t2d}, "cache.pt")


def main(cfg: dict) -> None:
    # cfg: src (the SafeAILab-EAGLE folder), target (a target folder transformers 4.x reads), records (JSONL of
    # {"messages"}), out, seed, draft_vocab_size, max_len, lr, warmup_steps (null: 12k scaled), threads
    torch.set_num_threads(int(cfg.get("threads") or 1))
    trainer_dir = os.path.join(cfg["src"], "eagle", "traineagle3")
    sys.path.insert(0, trainer_dir)
    import transformers  # first: it probes for datasets at import, which the stub below must not answer
    from accelerate.utils import set_seed
    from safetensors.torch import save_file
    from torch.utils.data import DistributedSampler
    from transformers import AutoTokenizer

    try:
        import datasets  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")

        def load_dataset(*a, **k):
            raise RuntimeError("scandata's tokenising pass is replaced by eagle3_ref_train.vocabulary_cache")
        stub.load_dataset = load_dataset
        sys.modules["datasets"] = stub
    import cnets  # noqa: E402  (SafeAILab's module, imports its siblings as top-level modules)
    from configs import EConfig

    out = os.path.abspath(cfg["out"])
    os.makedirs(out, exist_ok=True)
    os.chdir(out)  # scandata reads and writes cache.pt in the working directory
    if os.path.exists("cache.pt"):
        os.remove("cache.pt")
    ds_config = json.load(open(os.path.join(trainer_dir, "ds_config.json")))
    target_cfg = json.load(open(os.path.join(cfg["target"], "config.json")))
    records = [json.loads(line) for line in open(cfg["records"]) if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(cfg["target"])
    data, digest = examples(records, tokenizer, cfg["max_len"])
    vocabulary_cache(cnets, data, cfg["draft_vocab_size"], target_cfg["vocab_size"])

    set_seed(cfg["seed"])  # main.py: set_seed(0) before the model is built
    config = EConfig(vocab_size=target_cfg["vocab_size"], hidden_size=target_cfg["hidden_size"],
                     intermediate_size=target_cfg["intermediate_size"], num_hidden_layers=1,
                     num_attention_heads=target_cfg["num_attention_heads"],
                     num_key_value_heads=target_cfg["num_key_value_heads"], hidden_act=target_cfg["hidden_act"],
                     max_position_embeddings=target_cfg["max_position_embeddings"],
                     rms_norm_eps=target_cfg["rms_norm_eps"], pad_token_id=target_cfg.get("pad_token_id"),
                     draft_vocab_size=cfg["draft_vocab_size"])
    train_config = SimpleNamespace(bs=ds_config["train_micro_batch_size_per_gpu"], num_epochs=1,
                                   max_len=cfg["max_len"], gradient_checkpointing=False)
    model = cnets.Model(config, ds_config, train_config, path=cfg["target"], load_emb=True, load_head=True)
    model.target_model.float()
    model.scandata(None, None)  # loads cache.pt
    attn = model.midlayer.self_attn
    attn.rotary_emb = cnets.LlamaRotaryEmbedding(attn.head_dim, max_position_embeddings=attn.max_position_embeddings,
                                                 base=target_cfg["rope_theta"])

    opt_cfg = ds_config["optimizer"]["params"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0, betas=tuple(opt_cfg["betas"]), weight_decay=opt_cfg["weight_decay"])
    accumulation, clip = ds_config["gradient_accumulation_steps"], ds_config["gradient_clipping"]
    peak = cfg["lr"] if cfg.get("lr") is not None else ds_config["scheduler"]["params"]["warmup_max_lr"]
    total = len(data) // accumulation
    warmup = cfg.get("warmup_steps") or max(2, round(REFERENCE_WARMUP * total / REFERENCE_TOTAL))
    sampler = DistributedSampler(range(len(data)), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(1)  # main.py: train_sampler.set_epoch(epoch + 1) in epoch 0

    model.train()
    tokens, step, seconds, log_every = 0, 0, 0.0, max(1, total // 20)
    load_before = os.getloadavg()
    running = [0.0] * model.length
    optimizer.zero_grad()
    for i, idx in enumerate(sampler):
        t0 = time.perf_counter()
        ids, mask = data[idx]
        plosses, _, acces = model(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        loss = sum(0.8 ** k * plosses[k] for k in range(len(plosses)))  # main.py's ploss_weight
        (loss / accumulation).backward()  # DeepSpeed divides by gradient_accumulation_steps
        tokens += int(mask.sum())
        running = [r + a for r, a in zip(running, acces)]
        if (i + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, peak, warmup, total)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        seconds += time.perf_counter() - t0
        if (i + 1) % (log_every * accumulation) == 0:
            acc = " ".join(f"{r / (log_every * accumulation):.2f}" for r in running[:4])
            print(f"[reference] step {step}/{total} lr {optimizer.param_groups[0]['lr']:.2e} loss {loss.item():.3f} "
                  f"train acc@1-4 {acc} {tokens / seconds:.0f} tokens/s", file=sys.stderr, flush=True)
            running = [0.0] * model.length

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not k.startswith("target_model.") and k != "embed_tokens.weight"}  # save_16bit_model: no frozen
    state["t2d"], state["d2t"] = state["t2d"].bool(), state["d2t"].long()
    save_file({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()},
              os.path.join(out, "model.safetensors"))
    os.remove("cache.pt")
    json.dump({"trained_tokens": tokens, "train_seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
               "optimizer_steps": step, "micro_batches": len(data), "data_sha256": digest,
               "lr": {"peak": peak, "warmup_steps": warmup, "total_steps": total, "schedule": "WarmupDecayLR, log "
                      "warm-up from 0, linear decay to 0 at total_steps (DeepSpeed's step semantics)"},
               "ttt_steps": model.length, "step_weights": [0.8 ** k for k in range(model.length)],
               "threads": torch.get_num_threads(), "load_average": {"before": load_before, "after": os.getloadavg()},
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version()}},
              open(os.path.join(out, "train.json"), "w"), indent=1)


if __name__ == "__main__":
    main(json.load(open(sys.argv[1])))
