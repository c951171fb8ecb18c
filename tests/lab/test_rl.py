"""The RL step (``helpers.lab.rl``): ours against the float64 reference on full logits, values and
gradients, on an irregular shape (B=5, T=7, V=257, D=24) with a completion mask, clipped ratios, the
k3 KL, the entropy bonus, a temperature and a soft cap, in every aggregation; the group-normalised
advantages; clear errors; and a tiny policy that GRPO trains on the count-up task (seeded)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.lab import rl  # noqa: E402
from helpers.spec import relative_error  # noqa: E402

B, T, V, D = 5, 7, 257, 24
TOL = 2e-5  # fp32 under the interpreter, as tests/cce/test_outputs.py


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(B, T, D, generator=g) / D**0.25
    C = torch.randn(V, D, generator=g) / D**0.25
    x = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    x[~mask] = V + 5  # padding: out of range, never read
    with torch.no_grad():
        logprob = rl.logits_grpo_loss(E, C, x, torch.zeros(B), mask, temperature=0.7, softcap=6.0,
                                      dtype=torch.float64).logprob.float()
    # The sampling policy a little off the current one, so that some ratios leave [0.8, 1.28].
    old = torch.where(mask, logprob + 0.3 * torch.randn(B, T, generator=g), -1e4)  # masked: huge, ignored
    ref = torch.where(mask, logprob + 0.2 * torch.randn(B, T, generator=g), 0.0)
    rewards = torch.rand(B * 2, generator=g)
    advantages = rl.group_advantages(rewards, 2)[:B]
    return E, C, x, mask, old, ref, advantages


OPTIONS = dict(temperature=0.7, softcap=6.0, eps_low=0.2, eps_high=0.28, kl_coef=0.05, entropy_coef=0.01)


def loss_and_grads(fn, E, C, *args, dtype=None, **options):
    E = E.detach().to(dtype or E.dtype).requires_grad_(True)
    C = C.detach().to(dtype or C.dtype).requires_grad_(True)
    out = fn(E, C, *args, **options)
    out.loss.backward()
    return out, E.grad, C.grad


@pytest.mark.parametrize("aggregation", rl.AGGREGATIONS)
def test_ours_matches_the_float64_reference_on_full_logits(aggregation):
    E, C, x, mask, old, ref, advantages = make_batch()
    extra = {"max_tokens": 9} if aggregation == "constant" else {}
    args = (x, advantages, mask)
    kwargs = dict(old_logprob=old, ref_logprob=ref, aggregation=aggregation, **OPTIONS, **extra)
    ours, dE, dC = loss_and_grads(rl.grpo_loss, E, C, *args, **kwargs)
    spec, ref_dE, ref_dC = loss_and_grads(rl.logits_grpo_loss, E, C, *args, dtype=torch.float64, **kwargs)
    assert ours.clipped.any() and not ours.clipped.all(), "the case must clip some tokens, not all"
    assert torch.equal(ours.clipped, spec.clipped)
    assert abs(ours.loss.item() - spec.loss.item()) <= TOL * abs(spec.loss.item())
    for name in ("logprob", "entropy", "ratio", "kl"):
        assert relative_error(getattr(ours, name), getattr(spec, name)) < TOL, name
    assert relative_error(dE, ref_dE) < TOL and relative_error(dC, ref_dC) < TOL
    # masked tokens: nothing from them, whatever x and old_logprob hold there
    assert not dE[~mask].any() and torch.isfinite(dE).all()


def test_the_gate_can_fail_a_wrong_entropy_weight():
    E, C, x, mask, old, ref, advantages = make_batch()
    kwargs = dict(old_logprob=old, ref_logprob=ref, **OPTIONS)
    _, dE, _ = loss_and_grads(rl.grpo_loss, E, C, x, advantages, mask, **kwargs)
    _, ref_dE, _ = loss_and_grads(rl.logits_grpo_loss, E, C, x, advantages, mask, dtype=torch.float64,
                                  **{**kwargs, "entropy_coef": 1.5 * OPTIONS["entropy_coef"]})
    assert relative_error(dE, ref_dE) > 10 * TOL


def test_the_naive_path_is_the_same_loss_in_fp32():
    E, C, x, mask, old, ref, advantages = make_batch(1)
    kwargs = dict(old_logprob=old, ref_logprob=ref, **OPTIONS)
    naive, dE, _ = loss_and_grads(rl.logits_grpo_loss, E, C, x, advantages, mask, **kwargs)
    spec, ref_dE, _ = loss_and_grads(rl.logits_grpo_loss, E, C, x, advantages, mask, dtype=torch.float64, **kwargs)
    assert naive.loss.dtype == torch.float32
    assert relative_error(dE, ref_dE) < TOL


def test_on_policy_the_ratio_is_one_and_the_gradient_is_the_advantage_weighted_logprob():
    E, C, x, mask, _, _, advantages = make_batch(2)
    out, dE, dC = loss_and_grads(rl.grpo_loss, E, C, x, advantages, mask)
    assert torch.equal(out.ratio[mask], torch.ones(int(mask.sum()))) and not out.clipped.any()
    # -sum(A logp) / tokens: REINFORCE with a group baseline
    E2, C2 = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    logprob = rl.logits_grpo_loss(E2, C2, x, advantages, mask, dtype=None).logprob
    from helpers.cce import linear_cross_entropy_outputs

    lp = linear_cross_entropy_outputs(E2, C2, torch.where(mask, x, -100)).logprob
    (-(advantages[:, None] * lp).sum() / mask.sum()).backward()
    assert relative_error(dE, E2.grad) < TOL and relative_error(dC, C2.grad) < TOL
    assert torch.allclose(logprob, lp.detach(), atol=1e-5)


def test_the_aggregations_weigh_tokens_as_trl_does():
    """Hand-made per-token values: a long sequence and a short one."""
    logprob = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0])
    loss = {a: rl.policy_objective(logprob, torch.zeros(2, 4), advantages, mask, aggregation=a).loss.item()
            for a in rl.AGGREGATIONS}
    # per token -A: [-1]*4 and [+1]
    assert loss["token"] == pytest.approx((-4 + 1) / 5)
    assert loss["sequence"] == pytest.approx((-1 + 1) / 2)
    assert loss["constant"] == pytest.approx((-4 + 1) / (2 * 4))


def test_policy_objective_names_its_own_arguments():
    with pytest.raises(ValueError, match=r"mask must have logprob's shape \(2, 4\)"):
        rl.policy_objective(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"entropy and mask must have logprob's shape"):
        rl.policy_objective(torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 4, dtype=torch.bool))


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    A = rl.group_advantages(rewards, 4)
    assert torch.allclose(A[:4], (rewards[:4] - 0.25) / (rewards[:4].std() + 1e-4))
    assert torch.equal(A[4:], torch.zeros(4))  # no signal in a group of equal rewards
    assert torch.allclose(rl.group_advantages(rewards, 4, scale="none")[:4], rewards[:4] - 0.25)


@pytest.mark.parametrize("call, message", [
    (lambda: rl.group_advantages(torch.ones(6), 4), "not a multiple of group_size=4"),
    (lambda: rl.group_advantages(torch.ones(2, 4), 4), "rewards must be a 1-D tensor"),
    (lambda: rl.group_advantages(torch.ones(4), 1), "group_size must be an int >= 2"),
    (lambda: rl.group_advantages(torch.ones(4), 2, scale="max"), "scale must be one of"),
    (lambda: rl.group_advantages(torch.ones(4), 2, eps=0), "eps must be a finite number > 0"),
])
def test_group_advantages_refuse_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("change, error, message", [
    ({"advantages": torch.zeros(4)}, ValueError, r"advantages must be \(B,\) = \(5,\)"),
    ({"mask": torch.ones(5, 6, dtype=torch.bool)}, ValueError, r"mask must have x's shape \(5, 7\)"),
    ({"old_logprob": torch.zeros(5, 7, dtype=torch.long)}, TypeError, "old_logprob must be a floating-point"),
    ({"eps_low": 1.0}, ValueError, r"eps_low must be in \[0, 1\)"),
    ({"eps_high": -0.1}, ValueError, "eps_high must be >= 0"),
    ({"eps_high": float("inf")}, ValueError, "eps_high must be a finite number, got inf"),
    ({"kl_coef": True}, ValueError, "kl_coef must be a finite number, got True"),
    ({"entropy_coef": float("inf")}, ValueError, "entropy_coef must be a finite number, got inf"),
    ({"advantages": torch.zeros(5, device="meta")}, ValueError, r"advantages must be on x's device \(cpu\), got meta"),
    ({"kl_coef": 0.1, "ref_logprob": None}, ValueError, "kl_coef=0.1 needs ref_logprob"),
    ({"aggregation": "bnpo"}, ValueError, "aggregation must be one of"),
    ({"max_tokens": 8}, ValueError, "max_tokens is the \"constant\" aggregation's"),
    ({"E": torch.zeros(35, D)}, ValueError, r"E must be the hidden states \(B, T, D\)"),
])
def test_bad_input_is_refused_naming_the_argument(change, error, message):
    E, C, x, mask, old, ref, advantages = make_batch()
    kwargs = dict(E=E, C=C, x=x, advantages=advantages, mask=mask, old_logprob=old, ref_logprob=ref)
    kwargs.update(change)
    for fn in (rl.grpo_loss, rl.logits_grpo_loss):
        if fn is rl.logits_grpo_loss and "E" in change:
            continue
        with pytest.raises(error, match=message):
            fn(**kwargs)


def test_a_kept_token_must_be_a_class_id_and_the_objective_takes_float_log_probabilities():
    """-100 at a kept token was read by the kernels as an ignored target (logp 0, ratio 1, no gradient) and
    still counted in the objective: a wrong loss, silently. A kept token outside [0, V) is refused, naming
    where; the masked ones may hold anything. And integer log-probabilities (an int advantage then rounds
    to 0) are refused."""
    E, C, x, mask, old, ref, advantages = make_batch()
    x = x.clone()
    x[0, 0] = -100
    with pytest.raises(ValueError, match=rf"x must hold token ids in \[0, {V}\) wherever mask is True.*got -100 at \(0, 0\)"):
        rl.grpo_loss(E, C, x, advantages, mask, old_logprob=old)
    x[0, 0] = 1
    rl.grpo_loss(E, C, x, advantages, mask, old_logprob=old)  # masked positions hold V + 5: never read
    with pytest.raises(TypeError, match="logprob must be a floating-point tensor, got torch.int64"):
        rl.policy_objective(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), advantages, mask)
    with pytest.raises(ValueError, match=r"mask must be given, \(B, T\) = \(5, 7\)"):
        rl.policy_objective(torch.zeros(B, T), torch.zeros(B, T), advantages, None)
    with pytest.raises(ValueError, match="temperature must be at least 1 / 3.4e"):
        rl.grpo_loss(E, C, x, advantages, mask, temperature=1e-40)


def test_grpo_trains_a_tiny_policy():
    """10 GRPO steps of 4 prompts x 8 completions x 5 tokens (V=16, D=16), two iterations a batch
    (so the ratio and the clip act), a KL to the initial policy and an entropy bonus: the mean
    reward rises from chance (1/16 a token) to about 0.4. Deterministic: a repeat gives the same
    curve. The Turing tier's tiles: fewer, larger programs under the interpreter (3x faster here)."""
    def run(steps):
        torch.manual_seed(0)
        policy = rl.TinyPolicy(16, 16, 5)
        return rl.train_grpo(policy, steps=steps, prompts_per_step=4, group_size=8, T=5, lr=4e-2, seed=0,
                             iterations=2, kl_coef=0.01, entropy_coef=0.001, configs="turing-64k")

    curves = run(10)
    reward = curves["reward"]
    assert sum(reward[:3]) / 3 < 0.15 and sum(reward[-3:]) / 3 > 0.3, reward
    assert max(curves["clipped"]) > 0 and max(curves["kl"]) > 0
    assert run(2)["reward"] == reward[:2]


@pytest.mark.parametrize("aggregation", rl.AGGREGATIONS)
def test_liger_matches_the_float64_reference_without_the_entropy_bonus(aggregation):
    """The fused peer on the same objective (its loss types for our aggregations), padding and a huge
    stored logp_old at masked tokens included: loss, dE and dC within fp32's tolerance."""
    E, C, x, mask, old, ref, advantages = make_batch()
    extra = {"max_tokens": 9} if aggregation == "constant" else {}
    # Liger's GRPO loss has no soft cap and no entropy bonus
    options = {k: v for k, v in OPTIONS.items() if k not in ("softcap", "entropy_coef")}
    kwargs = dict(old_logprob=old, ref_logprob=ref, aggregation=aggregation, **options, **extra)
    liger, dE, dC = loss_and_grads(rl.liger_grpo_loss, E, C, x, advantages, mask, **kwargs)
    spec, ref_dE, ref_dC = loss_and_grads(rl.logits_grpo_loss, E, C, x, advantages, mask, dtype=torch.float64, **kwargs)
    assert abs(liger.loss.item() - spec.loss.item()) <= TOL * abs(spec.loss.item())
    assert relative_error(dE, ref_dE) < TOL and relative_error(dC, ref_dC) < TOL


def test_liger_refuses_what_it_cannot_compute():
    E, C, x, mask, old, ref, advantages = make_batch()
    with pytest.raises(ValueError, match="no entropy bonus: entropy_coef must be 0, got 0.01"):
        rl.liger_grpo_loss(E, C, x, advantages, mask, entropy_coef=0.01)
    with pytest.raises(ValueError, match=r"one advantage per sequence, \(B,\), got \(5, 7\)"):
        rl.liger_grpo_loss(E, C, x, advantages[:, None].expand(B, T), mask)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"chunk_size must be a positive int .*got {bad!r}"):
            rl.liger_grpo_loss(E, C, x, advantages, mask, chunk_size=bad)


def tf32_setting():
    matmul = torch.backends.cuda.matmul
    return matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32


def test_liger_tuned_is_liger_in_chunks_of_sequences_with_tf32_for_the_call_only(monkeypatch):
    """The tuned settings change how Liger runs, not what it computes: in chunks of 2 sequences (of 5) its
    loss and gradients are its default's within fp32's rounding; TF32 is set for the call only (back as it
    was after it, also when the call fails), and left alone at the default allow_tf32=None."""
    E, C, x, mask, old, ref, advantages = make_batch()
    kwargs = dict(old_logprob=old, ref_logprob=ref, **{k: v for k, v in OPTIONS.items() if k not in ("softcap", "entropy_coef")})
    default, dE, dC = loss_and_grads(rl.liger_grpo_loss, E, C, x, advantages, mask, **kwargs)
    before = tf32_setting()
    chunked, dE2, dC2 = loss_and_grads(rl.liger_grpo_loss, E, C, x, advantages, mask, chunk_size=2, allow_tf32=True,
                                       **kwargs)
    assert tf32_setting() == before
    assert abs(chunked.loss.item() - default.loss.item()) <= TOL * abs(default.loss.item())
    assert relative_error(dE2, dE) < TOL and relative_error(dC2, dC) < TOL
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    seen = []

    def fails(self, *args, **kwargs):
        seen.append(tf32_setting())
        raise RuntimeError("inside Liger")

    monkeypatch.setattr(LigerFusedLinearGRPOLoss, "forward", fails)
    for setting in (True, False, None):
        with pytest.raises(RuntimeError, match="inside Liger"):
            rl.liger_grpo_loss(E, C, x, advantages, mask, allow_tf32=setting, **kwargs)
        assert tf32_setting() == before
    assert seen[0] in ("tf32", True) and seen[1] in ("ieee", False) and seen[2] == before


def test_a_peer_that_raises_is_recorded_not_the_gates_failure(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sources must not be empty for symbol s10")

    monkeypatch.setitem(rl.PATHS, "liger_tuned", broken)
    check = rl.check_against_float64(rl.step_inputs(B, T, V, D, torch.float32, "cpu"))
    assert check["ok"] and check["within"]["liger"] and not check["within"]["liger_tuned"]
    assert check["failed"] == {"liger_tuned": "RuntimeError: sources must not be empty for symbol s10"}
    assert "liger_tuned" not in check["errors"]
    monkeypatch.setitem(rl.PATHS, "ours", broken)
    with pytest.raises(RuntimeError, match="symbol s10"):  # ours failing stops the gate
        rl.check_against_float64(rl.step_inputs(B, T, V, D, torch.float32, "cpu"))


def test_the_check_gates_every_path_at_its_own_options():
    check = rl.check_against_float64(rl.step_inputs(B, T, V, D, torch.float32, "cpu"))
    assert set(check["errors"]) == {"ours", "naive", "liger", "liger_tuned"} and check["ok"]
    assert all(check["within"].values())
    assert set(check["errors"]["liger"]) == {"dE", "dC"}  # no per-token outputs from Liger
    assert set(check["errors"]["ours"]) == {"logprob", "entropy", "dE", "dC"}
    # Liger's reference is the loss without the entropy bonus: against the one with it, dE is off.
    opts = {**rl.STEP_OPTIONS, "entropy_coef": 0.5}
    inputs = rl.step_inputs(B, T, V, D, torch.float32, "cpu")
    E = inputs.E.detach().requires_grad_(True)
    with_bonus = rl.logits_grpo_loss(E.double(), inputs.C.detach().double(), inputs.x, inputs.advantages, inputs.mask,
                                     old_logprob=inputs.old_logprob, ref_logprob=inputs.ref_logprob,
                                     dtype=torch.float64, **opts)
    dE_bonus, = torch.autograd.grad(with_bonus.loss, E)
    liger = rl.liger_grpo_loss(E, inputs.C.detach(), inputs.x, inputs.advantages, inputs.mask,
                               old_logprob=inputs.old_logprob, ref_logprob=inputs.ref_logprob,
                               **{**opts, "entropy_coef": 0.0})
    dE_liger, = torch.autograd.grad(liger.loss, E)
    assert relative_error(dE_liger, dE_bonus) > 100 * TOL
