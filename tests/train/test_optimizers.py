"""optim.name=muon: Muon steps exactly the hidden matrices, AdamW the rest, and the pair checkpoints as one."""
from __future__ import annotations

import copy

import pytest
import torch

from train.optimizers import Muon, MuonAdamW, build_optimizer, newton_schulz


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


COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_newton_schulz_runs_in_the_dtype_asked(shape):
    """In float32 the iteration matches float64's to float32 rounding; torch's own (bf16) is off by bf16's: an
    implementation that still rounded through bf16 fails the first assert."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    a, b, c = COEFFICIENTS
    x = g.double().T if shape[0] > shape[1] else g.double()
    x = x / x.norm()
    for _ in range(5):  # the quintic iteration written out in float64, as the reference
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    exact = x.T if shape[0] > shape[1] else x
    error = lambda x: float((x.double() - exact).norm() / exact.norm())
    assert error(newton_schulz(g, COEFFICIENTS, 5, 1e-7, torch.float32)) < 1e-5
    assert error(torch.optim._muon._zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7)) > 1e-3
    assert error(newton_schulz(g, COEFFICIENTS, 5, 1e-7, torch.bfloat16)) > 1e-3


def test_an_fp32_muon_step_is_torchs_step_computed_in_fp32(monkeypatch):
    """Momentum, Nesterov, decoupled decay and the AdamW-matched lr scale are torch.optim.Muon's, over three steps
    (the momentum buffer carries): torch's step with its orthogonalisation swapped for the float32 one is ours."""
    ours, ref, bf16 = Head(), Head(), Head()
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opt = Muon([ours.fc.weight], ns_dtype=torch.float32, **kwargs)
    ref_opt, bf16_opt = torch.optim.Muon([ref.fc.weight], **kwargs), torch.optim.Muon([bf16.fc.weight], **kwargs)
    fp32_ns = lambda g, coefficients, steps, eps: newton_schulz(g, coefficients, steps, eps, torch.float32)
    for seed in range(3):
        for m, o in ((ours, opt), (ref, ref_opt), (bf16, bf16_opt)):
            o.zero_grad()
            loss_of(m, seed).backward()
            with monkeypatch.context() as patch:
                if o is ref_opt:
                    patch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", fp32_ns)
                o.step()
    torch.testing.assert_close(ours.fc.weight, ref.fc.weight)
    assert not torch.equal(ours.fc.weight, bf16.fc.weight)  # torch's own step rounds through bf16
    assert opt.state[ours.fc.weight]["momentum_buffer"].dtype == torch.float32


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
