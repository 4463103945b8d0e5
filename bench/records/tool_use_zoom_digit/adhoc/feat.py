import sys, torch
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_model
from mmpo.vlm.processing import encode_prompts
path, task = sys.argv[1], sys.argv[2]
model, processor = load_model(path); model.eval()
rows = make_items(task, 40, seed=0)
p = encode_prompts(processor, rows, system_prompt="x")
with torch.no_grad():
    pv, grid = p["pixel_values"], p["image_grid_thw"]
    print("grid", grid[0].tolist(), "pixel_values", tuple(pv.shape), "pv range", pv.min().item(), pv.max().item())
    out = model.model.visual(pv, grid_thw=grid)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (list, tuple)): feats = torch.cat(list(feats))
    feats = feats.reshape(len(rows), -1, feats.shape[-1])
    print("vision tokens per image", feats.shape[1], "feat norm per token", feats.norm(dim=-1).mean().item())
    emb = model.get_input_embeddings().weight
    print("text embedding norm", emb.norm(dim=-1).mean().item())
    # between-image variation per token position
    var = feats.std(0).norm(dim=-1)  # per token
    print("between-image std norm per token:", [round(v, 3) for v in var.tolist()])
    labels = torch.tensor([int(r["answer"]) for r in rows])
    flat = feats.reshape(len(rows), -1)
    d = torch.cdist(flat, flat); d.fill_diagonal_(1e9)
    print("1-NN digit agreement over 40 images:", (labels[d.argmin(1)] == labels).float().mean().item())
