"""Peak memory and time of the sparse backward at the realistic regime's bench shapes, and the
bitwise repeat at the Qwen3 head with N = 131,072 (split and windowed tiles), on a GPU:

    python3 scripts/gpu/probe_memory.py OUT.json

A short check of a change to the sparse backward's memory budgets (``HostTuning.gc_bytes``, ``index_bytes``,
the split sums) before a full ``python -m helpers bench``; it reuses ``speed_v3.py``'s measurement.
"""

import json
import sys

import torch

sys.path.insert(0, "scripts/gpu")
import speed_v3  # noqa: E402

KEYS = ("case", "fwd_ms", "fwd_bwd_ms", "peak_over_lb", "density", "extra_bytes", "tile_ranges", "launches")


def main(out: str):
    records = []
    shapes = [("gemma2", 8192, 256_000, 2304)] + [("qwen3", n, 151_936, 1024) for n in (16_384, 65_536, 131_072)]
    for shape in shapes:
        r = speed_v3.measure(*shape, "realistic", "sparse", torch.bfloat16, "cuda", False)
        records.append(r)
        print({k: r.get(k) for k in KEYS}, flush=True)
    r = speed_v3.repeats_bitwise("qwen3", 131_072, 151_936, 1024, "realistic", torch.bfloat16, "cuda")
    records.append(r)
    print(r, flush=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
