"""The "gemm" backward with class weights and label smoothing by the G kernel's walk, against float64
(run from the checkout's root on a GPU; its output: class_weight_walks.txt)."""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from helpers.cce import linear_cross_entropy  # noqa: E402
from helpers.cce.kernels.configs import select_configs, tier  # noqa: E402
from helpers.spec import reference_loss, relative_error  # noqa: E402
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
N, V, D = 2048, 65536, 1024
g = torch.Generator(device="cpu").manual_seed(0)
base = select_configs(torch.device(dev))
hop = tier("hopper-227k")
bg = hop.backward_gemm[2]
variants = {
  "default": base,
  "no_tma": base.tuned(tma_min_chunk_flop=float("inf")),
  "no_g_store_tma": base.tuned(g_store_tma=False),
  "no_persistent": dataclasses.replace(hop, backward_gemm={**hop.backward_gemm, 2: dataclasses.replace(bg, persistent=0)}),
  "ampere": tier("ampere-163k"),
}
for dt in [torch.bfloat16, torch.float16]:
    E = (torch.randn(N, D, generator=g) * 0.05).to(dt).to(dev)
    C = (torch.randn(V, D, generator=g) * 0.05).to(dt).to(dev)
    x = torch.randint(0, V, (N,), generator=g).to(dev)
    x[::7] = 42
    w = (torch.rand(V, generator=g) + 0.25).to(dev)
    for ls, wt in [(0.1, w), (0.1, None), (0.0, w)]:
        opts = dict(weight=wt, label_smoothing=ls, ignore_index=42, softcap=30.0)
        Er, Cr = E.double().requires_grad_(), C.double().requires_grad_()
        reference_loss(Er, Cr, x, **opts).backward()
        for name, cfg in variants.items():
            Eo, Co = E.clone().requires_grad_(), C.clone().requires_grad_()
            st = {}
            linear_cross_entropy(Eo, Co, x, backward_impl="gemm", configs=cfg, stats=st, **opts).backward()
            print(str(dt)[6:], ls, wt is not None, name, st.get("g_kernels"), "dE %.2e dC %.2e" % (relative_error(Eo.grad, Er.grad), relative_error(Co.grad, Cr.grad)), flush=True)
