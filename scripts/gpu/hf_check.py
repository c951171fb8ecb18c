"""Train-step check of helpers.hf.patch on a Qwen3-0.6B-shaped model: loss, memory, time.

For each sequence length N (one sequence of N tokens) and each method, from the same weights:

- "hf":  the unpatched model, transformers' logits + ForCausalLMLoss;
- "cce": the same model after ``helpers.hf.patch``: no logits, our fused loss kernel;

one training step (zero_grad, forward with labels, backward, SGD step) in bf16 with gradient
checkpointing on, measuring the loss, the peak GPU memory above what was allocated before the step
(weights, the saved initial weights; no gradients: they are set to None before), and the step time
(CUDA events, median over --repeats steps after --warmup). At the smallest N it first checks
that the two methods agree: the loss, and the gradients of lm_head (tied to the embedding) and of
every parameter of decoder layer 0, relative L2 below --grad-rtol.

    python scripts/gpu/hf_check.py --output hf_check.jsonl                 # H200: N = 4096, 16384, 32768
    python scripts/gpu/hf_check.py --n 4096 8192 --output out.jsonl
    python scripts/gpu/hf_check.py --tiny --output /tmp/tiny.jsonl         # CPU, seconds (CI keeps it working)

Writes a results file (``helpers.compare.results_file``) to --output: the meta record (with
"kind": "env": the model, dtype and settings), then {"kind": "check"} and one {"kind": "step"} per
(N, method); exits 1 when the check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

# The scripts run from a checkout (or its copy on a GPU box), not from an installed package;
# helpers first: on a machine without CUDA it switches the Triton interpreter on (helpers.env).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import helpers  # noqa: E402,F401
from helpers.compare.heads import QWEN3  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402
from helpers.hf import patch, unpatch  # noqa: E402

import torch  # noqa: E402

QWEN3_06B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, vocab_size=QWEN3.V, tie_word_embeddings=True,
    max_position_embeddings=40960, rms_norm_eps=1e-6,
)
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=256, tie_word_embeddings=True,
    max_position_embeddings=256,
)
METHODS = ("hf", "cce")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=None,
                   help="sequence lengths (default 4096 16384 32768; --tiny: 32 64)")
    p.add_argument("--output", required=True, help="JSON lines written here")
    p.add_argument("--tiny", action="store_true", help="tiny config on the CPU in fp32 (seconds)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per (N, method) (default 2; tiny 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per (N, method) (default 5; tiny 2)")
    p.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate")
    p.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager, flash_attention_2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-rtol", type=float, default=5e-3, help="check: |loss_cce - loss_hf| / loss_hf")
    p.add_argument("--grad-rtol", type=float, default=2e-2, help="check: relative L2 of each gradient")
    args = p.parse_args(argv)
    args.n = sorted(args.n or ([32, 64] if args.tiny else [4096, 16384, 32768]))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.tiny else 5)
    return args


def build_model(args, device, dtype):
    import transformers

    cfg = transformers.Qwen3Config(**(TINY if args.tiny else QWEN3_06B), use_cache=False)
    cfg._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in place, in the training dtype, on the device
    try:
        with torch.device(device):
            model = transformers.Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    wrong = {p.dtype for p in model.parameters()} - {dtype}
    assert not wrong, f"parameters built in {wrong}, not {dtype}"
    # transformers >= 5.2x names it activation_checkpointing_enable; 5.17 has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    return model


def make_batch(n, vocab, device, seed):
    g = torch.Generator().manual_seed(seed + n)
    ids = torch.randint(0, vocab, (1, n), generator=g)
    return ids.to(device), ids.clone().to(device)


class Meter:
    """Step time and peak memory above the memory allocated before the step."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.t0, self.t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.t1.record()
            torch.cuda.synchronize()
            return self.t0.elapsed_time(self.t1), torch.cuda.max_memory_allocated() - self.before
        return (time.perf_counter() - self.t0) * 1e3, None


def train_step(model, opt, ids, labels, meter):
    opt.zero_grad(set_to_none=True)
    meter.start()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    ms, peak = meter.stop()
    return loss.item(), ms, peak


def checked_params(model):
    """lm_head's weight (the embedding's, tied) and every parameter of the first decoder layer."""
    params = {"lm_head.weight": model.lm_head.weight}
    params.update({f"model.layers.0.{k}": p for k, p in model.model.layers[0].named_parameters()})
    return params


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in checked_params(model).items()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def rel_l2(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(model, args, device):
    """Loss and gradients of the two methods at the smallest N, from the same weights."""
    n = args.n[0]
    ids, labels = make_batch(n, model.config.vocab_size, device, args.seed)
    loss_hf, g_hf = loss_and_grads(model, ids, labels)
    patch(model)
    try:
        loss_cce, g_cce = loss_and_grads(model, ids, labels)
    finally:
        unpatch(model)
    errors = {name: rel_l2(g_cce[name], g_hf[name]) for name in g_hf}
    loss_err = abs(loss_cce - loss_hf) / abs(loss_hf)
    ok = math.isfinite(loss_cce) and loss_err <= args.loss_rtol and max(errors.values()) <= args.grad_rtol
    return dict(kind="check", n=n, loss_hf=loss_hf, loss_cce=loss_cce, loss_rel_err=loss_err,
                grad_rel_l2=errors, grad_rtol=args.grad_rtol, loss_rtol=args.loss_rtol, ok=ok)


def run_method(model, initial, method, n, args, device):
    model.load_state_dict(initial)  # every (N, method) starts from the same weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ids, labels = make_batch(n, model.config.vocab_size, device, args.seed)
    meter = Meter(device)
    if method == "cce":
        patch(model)
    row = dict(kind="step", n=n, method=method)
    try:
        losses, times, peaks = [], [], []
        for i in range(args.warmup + args.repeats):
            loss, ms, peak = train_step(model, opt, ids, labels, meter)
            losses.append(loss)
            if i >= args.warmup:
                times.append(ms)
                peaks.append(peak)
        row.update(
            loss_first=losses[0],  # from the initial weights: comparable across methods
            losses=losses,
            step_ms_median=statistics.median(times),
            step_ms=times,
            peak_mib_above_weights=None if peaks[0] is None else max(peaks) / 2**20,
            status="ok",
        )
    except torch.cuda.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0])
    finally:
        if method == "cce":
            unpatch(model)
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main(argv=None):
    args = parse_args(argv)
    import transformers

    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32  # the Triton interpreter has no bf16
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --tiny on a CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16

    model = build_model(args, device, dtype)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    env = dict(  # beside run_meta's device and versions
        kind="env", transformers=transformers.__version__, dtype=str(dtype),
        tiny=args.tiny, config=TINY if args.tiny else QWEN3_06B, attn=args.attn, lr=args.lr,
        warmup=args.warmup, repeats=args.repeats, gradient_checkpointing=True,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    rows = []
    out = ResultsWriter(args.output, run_meta(device, **env))

    def emit(row):
        rows.append(row)
        out.append(row)

    result = check(model, args, device)
    emit(result)
    for n in args.n:
        for method in args.methods:
            emit(run_method(model, initial, method, n, args, device))

    print(f"\ncheck at N={result['n']}: loss hf {result['loss_hf']:.6f} cce {result['loss_cce']:.6f} "
          f"(rel {result['loss_rel_err']:.1e}); max grad rel L2 {max(result['grad_rel_l2'].values()):.1e} "
          f"(lm_head {result['grad_rel_l2']['lm_head.weight']:.1e}) -> {'OK' if result['ok'] else 'FAIL'}")
    print(f"{'N':>7} {'method':>6} {'loss':>10} {'peak MiB':>10} {'step ms':>9}")
    for row in rows:
        if row["kind"] != "step":
            continue
        if row["status"] != "ok":
            print(f"{row['n']:>7} {row['method']:>6} {row['status']:>10}")
            continue
        peak = "-" if row["peak_mib_above_weights"] is None else f"{row['peak_mib_above_weights']:.0f}"
        print(f"{row['n']:>7} {row['method']:>6} {row['loss_first']:>10.5f} {peak:>10} {row['step_ms_median']:>9.1f}")
    print(f"wrote {args.output}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
