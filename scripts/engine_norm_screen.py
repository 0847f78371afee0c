"""Run a ``ragcache`` command with the blend adapter's RMS norms on vLLM's C kernels.

vLLM's CPU build ships ``_C.fused_add_rms_norm`` and ``_C.rms_norm`` but runs its own RMSNorm in
the native torch form (vLLM 0.32 registers the C kernels for GPUs only), and so does the blend
adapter, which calls the model's own modules. This screen swaps the kernels in for the adapter's
``qkv`` and ``finish_layer`` only, so vLLM's own forward (full prefill, chunk KV precompute) keeps
its arithmetic and the blend's recomputed tokens differ from it by the kernels' rounding; it shows
what the swap costs in fidelity and saves in operators (docs/fidelity.md, "Precision")::

    RAGCACHE_ENGINE_NORM=c python scripts/engine_norm_screen.py bench ttft --dataset musique \\
        --offset 50 --n 8 --passages 5 --modes full,blend --ratios 0.15,1 --no-nll --out c.json
    RAGCACHE_ENGINE_NORM=native python scripts/engine_norm_screen.py bench ttft ... --out native.json

The engine must run in this process (``engine.in_process``, the default). Not a ragcache setting.
"""

from __future__ import annotations

import os
import sys
import threading

import torch


def _swap_in_c_kernels() -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm

    from ragcache.engine.ops.llama import VLLMLlamaOps

    state = threading.local()
    native = RMSNorm.forward_native

    def forward_native(self, x, residual=None):
        if not getattr(state, "adapter", False) or self.variance_size_override is not None \
                or self.weight.dtype != x.dtype:
            return native(self, x, residual)
        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            torch.ops._C.rms_norm(out, x.contiguous(), self.weight.data, self.variance_epsilon)
            return out
        x, residual = x.contiguous(), residual.contiguous()  # the kernel writes both in place
        torch.ops._C.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual

    RMSNorm.forward_native = forward_native
    for name in ("qkv", "finish_layer"):
        method = getattr(VLLMLlamaOps, name)

        def in_adapter(self, *args, _method=method, **kwargs):
            state.adapter = True
            try:
                return _method(self, *args, **kwargs)
            finally:
                state.adapter = False

        setattr(VLLMLlamaOps, name, in_adapter)


def main() -> int:
    norm = os.environ.get("RAGCACHE_ENGINE_NORM", "c")
    if norm not in ("c", "native"):
        raise SystemExit(f"RAGCACHE_ENGINE_NORM must be 'c' or 'native', got {norm!r}")
    if norm == "c":
        _swap_in_c_kernels()
        print("the blend adapter's RMS norms run on vLLM's C kernels", file=sys.stderr)
    from app.cli import main as cli

    sys.argv = ["ragcache", *sys.argv[1:]]
    return cli()


if __name__ == "__main__":
    sys.exit(main())
