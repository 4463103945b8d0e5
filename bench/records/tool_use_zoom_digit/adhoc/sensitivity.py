import torch
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_model
from mmpo.vlm.processing import encode_prompts
model, processor = load_model("runs/box/base"); model.eval()
rows = make_items("zoom_digit_box_read", 40, seed=0)
rows = [r for r in rows]
# same text for all: override problem
for r in rows: r["problem"] = "What digit?"
p = encode_prompts(processor, rows, system_prompt="x")
ids = p["input_ids"]
print("seq", ids.shape, "image pad count per row", (ids == model.config.image_token_id).sum(1)[:4].tolist())
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=p["attention_mask"], pixel_values=p["pixel_values"], image_grid_thw=p["image_grid_thw"])
    last = out.logits[:, -1]
    print("logit std across images (last pos)", last.std(0).mean().item(), "logit std across vocab", last.std(1).mean().item())
    h = out.hidden_states if hasattr(out, "hidden_states") and out.hidden_states is not None else None
    # vision embeddings inserted?
    emb = model.get_input_embeddings()(ids)
    print("attention mask sum", p["attention_mask"].sum(1)[:4].tolist())
    zero = model(input_ids=ids, attention_mask=p["attention_mask"], pixel_values=torch.zeros_like(p["pixel_values"]), image_grid_thw=p["image_grid_thw"]).logits[:, -1]
    print("change vs zero image", (zero - last).abs().mean().item())
