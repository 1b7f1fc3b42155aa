"""PyTorch peers for bench.e2e: the same model and shapes as a Tessera bench spec, run by Hugging Face
`transformers` on the same GPU, in a process of their own (JAX's allocator holds most of the card in the
parent; bench.e2e runs the peers before it starts JAX).

    python -m bench.peers llama_train specs/bench/llama_1b_train.yaml [--eager] [--steps 10] [--device cuda]
    python -m bench.peers gpt_oss_generate specs/gpt_oss_20b.yaml [--eager] [--set task.prompts=...]

Prints one line `RESULT {json}`: tokens/s, the median step in ms and the peak memory PyTorch's allocator saw.
The Llama train step is what the issue's peer row names: fp32 master weights, bf16 autocast, SDPA attention,
fused AdamW, `torch.compile` unless --eager; loss over the shifted tokens as `transformers` computes it.
GPT-OSS generation is `transformers`' `generate` with a static KV cache (compiled by `generate` itself unless
--eager), greedy, every row decoding `max_new_tokens`, on random bf16 weights: `transformers` runs MXFP4
experts only through kernels fetched from the Hub, which a GPU machine here cannot reach, so its experts are
bf16 (4.2x the expert bytes Tessera reads) through its grouped-GEMM experts where it has them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _llama_config(args: dict, seq: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=int(args["vocab"]), hidden_size=int(args["d_model"]), intermediate_size=int(args["d_ff"]),
        num_hidden_layers=int(args["layers"]), num_attention_heads=int(args["heads"]),
        num_key_value_heads=int(args["kv_heads"]), head_dim=int(args["head_dim"]),
        rope_theta=float(args.get("rope_theta", 10000.0)), rms_norm_eps=float(args.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(args.get("tie_embeddings", False)), max_position_embeddings=seq,
        attn_implementation="sdpa")


def llama_train(model_args: dict, batch: int, seq: int, *, compiled: bool, steps: int = 10, warmup: int = 3,
                device: str = "cuda") -> dict:
    """One `transformers` Llama optimizer step timed `steps` times after `warmup` (compile included there)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(model_args, seq)).to(device)  # fp32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device == "cuda")
    run = torch.compile(model) if compiled else model
    tokens = torch.randint(0, int(model_args["vocab"]), (batch, seq), device=device)
    kind = "cuda" if device.startswith("cuda") else "cpu"

    def step():
        with torch.autocast(device_type=kind, dtype=torch.bfloat16):
            loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(max(warmup, 1)):
        loss = step()
    sync()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    med = statistics.median(times)
    return {"peer": f"transformers {transformers.__version__} + torch {torch.__version__}"
                    + (" compile" if compiled else " eager"),
            "tokens_per_s": batch * seq / med, "step_ms": med * 1e3, "warmup_s": first, "loss": float(loss.detach()),
            "peak_bytes": torch.cuda.max_memory_allocated() if kind == "cuda" else None}


def _gpt_oss_config(args: dict):
    import transformers

    layers, window = int(args["layers"]), int(args.get("window", 128))
    config = transformers.GptOssConfig(
        vocab_size=int(args["vocab"]), hidden_size=int(args["d_model"]), intermediate_size=int(args["d_ff"]),
        num_hidden_layers=layers, num_attention_heads=int(args["heads"]), num_key_value_heads=int(args["kv_heads"]),
        head_dim=int(args["head_dim"]), num_local_experts=int(args["experts"]), num_experts_per_tok=int(args["top_k"]),
        sliding_window=window, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(layers)])
    for impl in ("grouped_mm", "batched_mm"):  # the fastest experts this transformers has, else its loop
        try:
            config.experts_implementation = impl
            return config, impl
        except Exception:  # noqa: BLE001 - an older transformers without the setting
            continue
    return config, "eager loop"


def gpt_oss_generate(model_args: dict, prompts: list[list[int]], max_new: int, *, compiled: bool, steps: int = 3,
                     device: str = "cuda") -> dict:
    """`generate` of `max_new` greedy tokens for the batch of prompts, timed `steps` times after a warm-up that
    compiles; decode tokens/s from the full call minus a one-token call (the prefill), as `tessera run` counts."""
    import torch
    import transformers

    torch.manual_seed(0)
    config, experts = _gpt_oss_config(model_args)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformers.GptOssForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, eos_token_id=None,
              attention_mask=torch.ones_like(ids))
    if not compiled:
        kw["disable_compile"] = True

    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            sync()
            best = min(best, time.perf_counter() - start)
        assert out.shape == (ids.shape[0], ids.shape[1] + n), out.shape
        return best

    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **kw)  # warm-up: compiles
    sync()
    first = time.perf_counter() - start
    full, one = timed(max_new), timed(1)
    b = ids.shape[0]
    return {"peer": f"transformers {transformers.__version__} + torch {torch.__version__} generate, static cache"
                    + (", compiled" if compiled else ", eager") + f", bf16 experts ({experts})",
            "tokens_per_s": b * (max_new - 1) / max(full - one, 1e-9), "step_ms": (full - one) / max(max_new - 1, 1) * 1e3,
            "first_token_s": one, "warmup_s": first,
            "peak_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None}


PEERS = {"llama_train": llama_train, "gpt_oss_generate": gpt_oss_generate}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=sorted(PEERS))
    parser.add_argument("spec", help="the Tessera bench spec whose model and shapes the peer runs")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from tessera.spec import load_experiment  # the spec only: this process never starts JAX's backend

    exp = load_experiment(args.spec, overrides=args.overrides)
    model_args = dict(exp.model.args)
    if args.peer == "gpt_oss_generate":
        prompts = [list(p) for p in exp.task.prompts]
        result = gpt_oss_generate(model_args, prompts, int(exp.task.max_new_tokens), compiled=not args.eager,
                                  steps=min(args.steps, 3), device=args.device)
    else:
        result = llama_train(model_args, int(exp.task.batch), int(exp.task.seq_len),
                             compiled=not args.eager, steps=args.steps, device=args.device)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
