"""Direct reading probe: short prompt (crop + question), completion '<answer>N</answer>', AdamW on all weights;
held-out accuracy = argmax over the 10 digit tokens at the digit position. Usage: fastprobe.py MODEL TASK STEPS LR"""
import sys, time, torch, random
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_model
from mmpo.vlm.processing import encode_prompts
from mmpo.vlm.logprobs import completion_log_probs
torch.manual_seed(0)
path, task, steps, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
vision_mode = sys.argv[5] if len(sys.argv) > 5 else "train"   # train | freeze | freeze_blocks | lr0.1
bs = 16
model, processor = load_model(path); tok = processor.tokenizer
train = make_items(task, 2000, seed=0); test = make_items(task, 100, seed=0, split="test")
if len(sys.argv) > 6 and sys.argv[6] == "constq":  # one question for every row: only the image tells the digit
    for r in train + test:
        r["problem"] = "What digit is written in the zoomed view?"
digits = [tok(str(d), add_special_tokens=False)["input_ids"] for d in range(10)]
assert all(len(d) == 1 for d in digits), digits
digit_ids = torch.tensor([d[0] for d in digits])
pre = tok("<answer>", add_special_tokens=False)["input_ids"]
def batch(rows):
    prompts = encode_prompts(processor, rows, system_prompt="Answer with the digit.")
    ids = torch.tensor([pre + [digit_ids[int(r["answer"])].item()] for r in rows])
    return prompts, ids, torch.ones_like(ids)
vis = [p for n, p in model.named_parameters() if ".visual." in f".{n}" or n.startswith("visual")]
merger = [p for n, p in model.named_parameters() if "merger" in n]
rest = [p for n, p in model.named_parameters() if not any(p is q for q in vis)]
print("vision params", sum(p.numel() for p in vis), "merger", sum(p.numel() for p in merger), "rest", sum(p.numel() for p in rest))
if vision_mode == "freeze":
    groups = [{"params": rest}]
elif vision_mode == "freeze_blocks":
    groups = [{"params": rest}, {"params": merger}]
elif vision_mode.startswith("lr"):
    groups = [{"params": rest}, {"params": vis, "lr": lr * float(vision_mode[2:])}]
else:
    groups = [{"params": list(model.parameters())}]
opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
def evaluate():
    model.eval(); correct = 0
    with torch.no_grad():
        for i in range(0, len(test), 25):
            rows = test[i:i+25]; prompts, ids, att = batch(rows)
            out = model(**{k: v for k, v in prompts.items() if k in ("input_ids","attention_mask","pixel_values","image_grid_thw")} | {
                "input_ids": torch.cat([prompts["input_ids"], ids[:, :-1]], 1),
                "attention_mask": torch.cat([prompts["attention_mask"], att[:, :-1]], 1)})
            logits = out.logits[:, -1, digit_ids]
            correct += (logits.argmax(-1) == torch.tensor([int(r["answer"]) for r in rows])).sum().item()
    model.train(); return correct / len(test)
t0 = time.time(); rng = random.Random(0)
for step in range(1, steps + 1):
    rows = rng.sample(train, bs); prompts, ids, att = batch(rows)
    lp, _ = completion_log_probs(model, prompts, ids, att)
    loss = -lp[:, -1].mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 50 == 0:
        print(f"step {step} digit nll {loss.item():.3f} test acc {evaluate():.2f} ({time.time()-t0:.0f}s)", flush=True)
