"""optim.name=muon: Muon steps exactly the hidden matrices, AdamW the rest, and the pair checkpoints as one."""
from __future__ import annotations

import copy

import pytest
import torch

from train.optimizers import MuonAdamW, build_optimizer


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.fc(x)))


def loss_of(model, seed=0):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    return model(x).logsumexp(-1).mean()


def test_each_parameter_gets_the_update_of_its_own_optimizer():
    """One step equals torch's Muon on fc alone and AdamW on norm + lm_head alone: a split that sent lm_head to
    Muon, or stepped a parameter twice, fails."""
    model, muon_ref, adamw_ref = Head(), Head(), Head()
    opt = build_optimizer("muon", model.named_parameters(), lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)
    ref_m = torch.optim.Muon([muon_ref.fc.weight], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_a = torch.optim.AdamW([*adamw_ref.norm.parameters(), adamw_ref.lm_head.weight], lr=0.02, betas=(0.9, 0.95),
                              weight_decay=0.0)
    for m, o in ((model, opt), (muon_ref, ref_m), (adamw_ref, ref_a)):
        loss_of(m).backward()
        o.step()
    torch.testing.assert_close(model.fc.weight, muon_ref.fc.weight)
    torch.testing.assert_close(model.lm_head.weight, adamw_ref.lm_head.weight)
    torch.testing.assert_close(model.norm.weight, adamw_ref.norm.weight)
    assert not torch.allclose(model.fc.weight, adamw_ref.fc.weight)  # Muon's step is not AdamW's


def test_schedule_reaches_both_and_state_round_trips():
    model = Head()
    opt = build_optimizer("muon", model.named_parameters(), lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)
    assert isinstance(opt, MuonAdamW)
    for seed in range(2):
        opt.zero_grad()
        loss_of(model, seed).backward()
        opt.step()
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = build_optimizer("muon", twin.named_parameters(), lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        loss_of(m, 5).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)  # momentum and Adam moments came back
    frozen = {n: p.clone() for n, p in model.named_parameters()}
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # lr 0 in every group: nothing may move
    opt.zero_grad()
    loss_of(model, 6).backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, frozen[n], msg=n)


def test_unknown_optimizer_is_one_line():
    from heads.errors import UserError
    from train.module import OptimConfig

    with pytest.raises(UserError, match="optim.name=sgd is not an optimizer; choose one of adamw, muon"):
        OptimConfig(name="sgd")


def test_muon_under_deepspeed_is_refused_in_one_line(compose, tmp_path):
    from heads.errors import UserError
    from train.main import Job

    cfg = compose(tmp_path, "optim.name=muon", "trainer=deepspeed_zero2")
    with pytest.raises(UserError, match="optim.name=muon does not run under DeepSpeed.*trainer=ddp"):
        Job.from_cfg(cfg)


def test_auto_is_muon_except_under_deepspeed(compose, tmp_path):
    from train.main import Job

    for head in ("eagle", "eagle3", "mtp", "medusa"):
        assert Job.from_cfg(compose(tmp_path / f"a-{head}", f"head={head}")).optim.name == "muon"
        deepspeed = compose(tmp_path / f"b-{head}", f"head={head}", "trainer=deepspeed_zero2")
        assert Job.from_cfg(deepspeed).optim.name == "adamw"
    assert Job.from_cfg(compose(tmp_path / "c", "head=eagle3", "optim.name=adamw")).optim.name == "adamw"
