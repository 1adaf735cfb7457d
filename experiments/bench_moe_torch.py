"""transformers' own MoE blocks (what MegaTrain streams as its layer templates) on the GPU, forward +
backward, at the shapes of ``bench_moe.py``, for each experts implementation transformers offers; the
other side of the MoE layer comparison, run in the same call with the GPU image's torch.

    python3 experiments/bench_moe_torch.py [TOKENS] [OUT.json] [IMPL,IMPL...]
"""
import json, sys, time
import torch
import transformers

T = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
dev = "cuda"
IMPLS = sys.argv[3].split(",") if len(sys.argv) > 3 else ("eager", "grouped_mm", "batched_mm")
rows = []


def timed(fn, n=6):
    fn(); torch.cuda.synchronize()
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def run(name, make, h, k, f):
    active = 3 * 2 * T * k * h * f
    for impl in IMPLS:
        row = {"shape": name, "impl": impl, "transformers": transformers.__version__, "torch": torch.__version__}
        try:
            block = make(impl).to(dev, torch.bfloat16)
            x = torch.randn(T, h, device=dev, dtype=torch.bfloat16, requires_grad=True)

            def fwd():
                with torch.no_grad():
                    return block(x[None])

            def fwd_bwd():
                out = block(x[None])
                out = out[0] if isinstance(out, tuple) else out
                out.float().pow(2).sum().backward()

            tf = timed(fwd)
            tb = timed(fwd_bwd)
            row.update(fwd_ms=tf * 1e3, fwd_bwd_ms=tb * 1e3, active_tflops_fwd=active / tf / 1e12,
                       active_tflops_fwd_bwd=3 * active / tb / 1e12)
            print(f"{name:16s} {str(impl):11s} fwd {tf*1e3:8.2f} ms ({active/tf/1e12:6.1f} TF)  fwd+bwd {tb*1e3:8.2f} ms"
                  f" ({3*active/tb/1e12:6.1f} TF)", flush=True)
            del block, x
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
            print(f"{name:16s} {str(impl):11s} FAILED {repr(e)[:200]}", flush=True)
        torch.cuda.empty_cache()
        rows.append(row)


def qwen3moe(h, E, k, f):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    from transformers import Qwen3MoeConfig

    def make(impl):
        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=f, num_experts=E, num_experts_per_tok=k,
                             norm_topk_prob=True)
        if impl is not None:
            cfg._experts_implementation = impl
        return m.Qwen3MoeSparseMoeBlock(cfg)
    return make


def gptoss(h, E, k, f):
    from transformers.models.gpt_oss import modeling_gpt_oss as m
    from transformers import GptOssConfig

    def make(impl):
        cfg = GptOssConfig(hidden_size=h, intermediate_size=f, num_local_experts=E, num_experts_per_tok=k)
        if impl is not None:
            cfg._experts_implementation = impl
        return m.GptOssMLP(cfg)
    return make


def mixtral(h, E, k, f):
    from transformers.models.mixtral import modeling_mixtral as m
    from transformers import MixtralConfig

    def make(impl):
        cfg = MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=E, num_experts_per_tok=k)
        if impl is not None:
            cfg._experts_implementation = impl
        return m.MixtralSparseMoeBlock(cfg)
    return make


print(torch.cuda.get_device_name(), transformers.__version__, torch.__version__, flush=True)
run("olmoe", qwen3moe(2048, 64, 8, 1024), 2048, 8, 1024)
run("qwen3_30b_a3b", qwen3moe(2048, 128, 8, 768), 2048, 8, 768)
run("gpt_oss_120b", gptoss(2880, 128, 4, 2880), 2880, 4, 2880)
run("mixtral_8x7b", mixtral(4096, 8, 2, 14336), 4096, 2, 14336)
json.dump({"tokens": T, "rows": rows}, open(sys.argv[2] if len(sys.argv) > 2 else "moe_torch.json", "w"), indent=1)
