"""Temporary probe (not committed): GPT-2 small generate on GPU, kiln vs torch.compile vs eager."""
import sys, time, torch, kiln
from transformers import GPT2Config, GPT2LMHeadModel
dev = "cuda"
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32
which = sys.argv[2].split(",") if len(sys.argv) > 2 else ["eager", "kiln", "torch"]
torch.manual_seed(0)
cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768)
base = GPT2LMHeadModel(cfg).eval().to(dev, torch.bfloat16)
ids = torch.randint(0, 50000, (1, 16), device=dev)
def gen(m):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = m.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize(); return out, time.perf_counter() - t
with torch.no_grad():
    ref, _ = gen(base)
    for name in which:
        m = GPT2LMHeadModel(cfg).eval().to(dev, torch.bfloat16); m.load_state_dict(base.state_dict())
        if name == "kiln":
            kiln.reset(); m.forward = kiln.compile(m.forward)
        elif name == "torch":
            torch._dynamo.reset(); m.forward = torch.compile(m.forward)
        out1, first = gen(m)
        times = [gen(m)[1] for _ in range(3)]
        out2 = gen(m)[0]
        extra = ""
        if name == "kiln":
            c = kiln.counters; extra = f"captures={c.captures} recompiles={len(c.recompiles)} fallbacks={len(c.fallbacks)} breaks={len(c.graph_breaks)}"
        if name == "kiln":
            for r in kiln.counters.recompiles[:4]: print("  R", r, flush=True)
            for r in kiln.counters.fallbacks[:2]: print("  F", str(r)[:400], flush=True)
            print("\n".join(kiln.explain().sizes[:10]))
        print(f"{name:6s} same={torch.equal(out1, ref) and torch.equal(out2, ref)} first={first:.2f}s steady/token={1000*min(times)/tokens:.2f}ms {extra}", flush=True)
