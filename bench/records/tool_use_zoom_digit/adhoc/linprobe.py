import sys, torch
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_model
from mmpo.vlm.processing import encode_prompts
torch.manual_seed(0)
path, task = sys.argv[1], sys.argv[2]
model, processor = load_model(path); model.eval()
def feats(rows):
    out = []
    for i in range(0, len(rows), 100):
        p = encode_prompts(processor, rows[i:i+100], system_prompt="x")
        with torch.no_grad():
            f = model.model.visual(p["pixel_values"], grid_thw=p["image_grid_thw"])
            f = f.pooler_output if hasattr(f, "pooler_output") else f
        out.append(f.reshape(len(rows[i:i+100]), -1))
    return torch.cat(out)
train, test = make_items(task, 2000, seed=0), make_items(task, 300, seed=0, split="test")
xtr, xte = feats(train), feats(test)
ytr = torch.tensor([int(r["answer"]) for r in train]); yte = torch.tensor([int(r["answer"]) for r in test])
mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
W = torch.zeros(xtr.shape[1], 10, requires_grad=True); b = torch.zeros(10, requires_grad=True)
opt = torch.optim.Adam([W, b], lr=1e-2)
for it in range(300):
    loss = torch.nn.functional.cross_entropy(xtr @ W + b, ytr) + 1e-4 * (W ** 2).sum()
    opt.zero_grad(); loss.backward(); opt.step()
print(path, task, "linear probe on frozen vision features: train acc", ((xtr @ W + b).argmax(1) == ytr).float().mean().item(),
      "test acc", ((xte @ W + b).argmax(1) == yte).float().mean().item())
