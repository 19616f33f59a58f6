"""gpu_check phases titan_debug and titan_8b: TorchTitan's llama3 training step on one device.

Also the model builder and the torch-version shims that gpu_check_ft's replicas reuse.
"""

from __future__ import annotations

import gc
import time

from gpu_check import Result, error_text, quiet_cpu, say

# (flavor, layers kept (None = all), attention, batch, seq_len, warm-up steps, timed steps)
CASES = {
    "titan_debug": {
        "small": [("debugmodel", None, "sdpa", 2, 128, 1, 3), ("debugmodel", None, "flex", 2, 128, 1, 3)],
        "full": [("debugmodel", None, "sdpa", 8, 2048, 2, 10), ("debugmodel", None, "flex", 8, 2048, 2, 10)],
    },
    "titan_8b": {
        "small": [],
        "full": [("8B", 4, "sdpa", 2, 4096, 2, 6), ("8B", 4, "flex", 2, 4096, 2, 6)],
    },
}


def apply_compat() -> list[str]:
    """Let TorchTitan 0.3.0 (built against torch 2.13) run on an older torch; returns what changed.

    - torch.distributed.fsdp.DataParallelMeshDims (newer torch) is imported at module level by
      torchtitan.distributed.fsdp / full_dtensor; only FSDP paths use it, which this check never
      takes, so a placeholder lets `import torchtitan.models.llama3` succeed.
    - Decoder masks call create_block_mask(..., separate_full_blocks=...), a newer keyword.
    """
    import dataclasses
    import inspect

    import torch.distributed.fsdp as fsdp
    from torch.nn.attention import flex_attention as fa

    applied = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        applied.append("placeholder torch.distributed.fsdp.DataParallelMeshDims")
    if "separate_full_blocks" not in inspect.signature(fa.create_block_mask).parameters:
        import torchtitan.models.common.attention as attention
        import torchtitan.models.common.decoder as decoder

        def create_attention_mask(*args, **kwargs):
            kwargs.pop("separate_full_blocks", None)
            return attention._compiled_create_block_mask(*args, **kwargs)

        attention.create_attention_mask = decoder.create_attention_mask = create_attention_mask
        applied.append("create_block_mask without separate_full_blocks")
    return applied


def plain_flex_compile() -> None:
    """Compile FlexAttention without TorchTitan's max-autotune options (faster to compile)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = torch.compile(flex_attention)


def build_model(flavor: str, layers: int | None, attn: str, device, dtype):
    """TorchTitan's llama3 config `flavor` (attn_backend="flex"), built like its trainer does:
    on meta, then to_empty on the device and init_states. attn="sdpa" swaps in plain causal
    SDPA (0.3.0's config API refuses attn_backend="sdpa" for language models)."""
    import torch
    from torchtitan.models.common import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs[flavor](attn_backend="flex")
    if layers is not None:
        config.layers = config.layers[:layers]
    if attn == "sdpa":
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
        for p in model.parameters():  # params only: the RoPE cache buffer stays complex
            p.data = p.data.to(dtype)
    return model, config


def make_batch(batch: int, seq: int, vocab: int, device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    positions = torch.arange(seq).repeat(batch, 1)
    return data[:, :-1].to(device), data[:, 1:].to(device), positions.to(device)


def loss_and_backward(model, attn: str, tokens, labels, positions):
    import torch.nn.functional as F

    masks = model.get_attention_masks(positions) if attn == "flex" else None
    logits = model(tokens, positions, masks)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    return loss


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _top_kernels(step, device, n: int = 8) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [[e.key[:90], round(e.self_device_time_total / 1e3, 3)] for e in events[:n]]


def run_case(case, device, dtype) -> dict:
    import torch
    import torch._dynamo

    flavor, layers, attn, batch, seq, warmup, steps = case
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, config = build_model(flavor, layers, attn, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens, labels, positions = make_batch(batch, seq, config.vocab_size, device, seed=0)
    out = {"params": sum(p.numel() for p in model.parameters()), "dtype": str(dtype),
           "layers": len(config.layers), "batch": batch, "seq_len": seq, "losses": []}

    def step():
        loss = loss_and_backward(model, attn, tokens, labels, positions)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    out["losses"].append(round(step().item(), 4))
    out["first_step_s"] = round(time.perf_counter() - start, 2)  # includes compilation
    for _ in range(warmup - 1):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _sync(device)
    step_s = (time.perf_counter() - start) / steps
    out["losses"].append(round(loss.item(), 4))
    out.update(step_ms=round(step_s * 1e3, 2), tokens_per_s=round(batch * seq / step_s))
    try:
        _, flops_per_token = config.get_nparams_and_flops(model, seq)
        out["tflops"] = round(flops_per_token * batch * seq / step_s / 1e12, 1)
    except Exception as exc:  # noqa: BLE001
        out["tflops"] = f"n/a: {exc!r}"[:200]
    counters = torch._dynamo.utils.counters
    out["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                     "frames_ok": counters["frames"]["ok"],
                     "graph_breaks": sum(counters["graph_break"].values())}
    if device.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["top_kernels_ms"] = _top_kernels(step, device)
        names = " ".join(k for k, _ in out["top_kernels_ms"]).lower()
        out["flex_kernel_seen"] = "flex" in names or "triton_tem" in names
    out["attention_compiled"] = attn == "flex" and out["dynamo"]["unique_graphs"] > 0
    return out


def _phase(res: Result, name: str, device: str, scale: str, flex_compile: str, **_) -> None:
    import torch

    quiet_cpu(device)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # bf16 is slow on CPU
    res.set(compat=apply_compat(), flex_compile=flex_compile, cases={})
    if flex_compile == "plain":
        plain_flex_compile()
    for case in CASES[name][scale]:
        label = f"{case[0]}{'' if case[1] is None else f'-{case[1]}L'}/{case[2]}"
        say(f"{label}: batch {case[3]} x {case[4]} tokens")
        try:
            out = run_case(case, dev, dtype)
            say(f"{label}: {out['step_ms']} ms/step, {out['tokens_per_s']} tok/s, "
                f"first step {out['first_step_s']}s")
        except Exception as exc:  # noqa: BLE001 - e.g. FlexAttention has no CPU backward
            out = {"error": error_text(exc, 1500)}
            say(f"{label}: error {str(exc).splitlines()[0][:150] if str(exc) else type(exc).__name__}")
        gc.collect()  # the case's model and optimizer
        res["cases"][label] = out
        res.set()


def phase_debug(res: Result, **kw) -> None:
    _phase(res, "titan_debug", **kw)


def phase_8b(res: Result, **kw) -> None:
    _phase(res, "titan_8b", **kw)


def summarize(res: dict) -> str:
    parts = []
    for label, out in res.get("cases", {}).items():
        if "error" in out:
            parts.append(f"{label} error")
        else:
            parts.append(f"{label} {out['step_ms']}ms {out['tokens_per_s']}tok/s"
                         + (f" {out['peak_mem_gib']}GiB" if "peak_mem_gib" in out else ""))
    return "; ".join(parts) or "no case ran"
