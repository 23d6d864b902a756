"""One forward per prompt for the K completions of a GRPO group (`--prompt_sharing`): the rows of a micro-batch
that start with the same prompt are packed into one row, the prompt once and then each completion, with positions
that restart after the prompt for each completion and an attention pattern in which a completion sees the prompt
and its own earlier tokens only. Each token then computes exactly what it computes in its own padded row (up to
the order of fp sums), and the hidden states and router logits are gathered back to the rows' layout, so the
log-probs, the losses, the load-balancing term and the mismatch metrics are the unshared ones, and their gradients
flow back through the gather into the one shared prompt.

GRPO's prompts are most of a row on short-answer tasks (the demo: ~170 prompt tokens, ~10-token answers, K = 8),
so the update computes about K times fewer positions. The pattern is a dense [T, T] mask per packed row (the
attention's masked path), and a packed row is as long as its prompt and all its completions: so a micro-batch
runs unshared when its packed attention would cost more than its padded rows' (G x Tp^2 > B x T^2: long completions
of a short prompt) or its masks would pass `max_mask_elements`."""
import torch

MAX_MASK_ELEMENTS = 16 * 2**20  # of the [G, Tp, Tp] pattern (the attention may hold it as floats: 4 bytes each)


def pack_prompts(input_ids, attention_mask, prompt_lens, pad_id: int = 0,
                 max_mask_elements: int = MAX_MASK_ELEMENTS) -> dict | None:
    """input_ids, attention_mask [B, T] (right-padded rows), prompt_lens [B] -> {"input_ids", "positions" [G, Tp],
    "mask" [G, Tp, Tp] bool, "index" [B, T]: each row position's flat index into the packed [G * Tp]}; None when no
    two rows share a prompt, when the packed attention would cost more than the rows' (G x Tp^2 > B x T^2), or when
    the pattern would exceed max_mask_elements."""
    B, T = input_ids.shape
    lengths = attention_mask.sum(1).tolist()
    plens = [int(p) for p in prompt_lens.tolist()]
    groups: dict = {}
    for i in range(B):
        groups.setdefault(tuple(input_ids[i, :plens[i]].tolist()), []).append(i)
    if len(groups) == B:
        return None
    sizes = [len(key) + sum(lengths[i] - len(key) for i in rows) for key, rows in groups.items()]
    G, Tp = len(groups), max(sizes)
    if G * Tp * Tp > min(B * T * T, max_mask_elements):
        return None
    device = input_ids.device
    packed = torch.full((G, Tp), pad_id, dtype=input_ids.dtype, device=device)
    positions = torch.zeros((G, Tp), dtype=torch.long, device=device)
    segment = torch.full((G, Tp), -2, dtype=torch.long, device=device)  # -1 prompt, k completion k, -2 padding
    index = torch.zeros((B, T), dtype=torch.long, device=device)
    for g, (key, rows) in enumerate(groups.items()):
        p = len(key)
        packed[g, :p] = input_ids[rows[0], :p]
        positions[g, :p] = torch.arange(p, device=device)
        segment[g, :p] = -1
        offset = p
        for k, i in enumerate(rows):
            c = lengths[i] - p
            index[i, :p] = g * Tp + torch.arange(p, device=device)
            packed[g, offset:offset + c] = input_ids[i, p:p + c]
            positions[g, offset:offset + c] = torch.arange(p, p + c, device=device)
            segment[g, offset:offset + c] = k
            index[i, p:p + c] = g * Tp + torch.arange(offset, offset + c, device=device)
            offset += c
    q, k = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(Tp, Tp, dtype=torch.bool, device=device).tril()
    mask = causal & ((k == -1) | (k == q)) & (k != -2)
    return {"input_ids": packed, "positions": positions, "mask": mask, "index": index}


def forward_shared(model, shared: dict, routed_experts=None) -> tuple:
    """model.forward_hidden over the packed rows -> (hidden [B, T, H], router logits, each [B * T, E]) in the
    rows' layout (a row's padding gets some real position's values: masked out downstream, as padding is)."""
    hidden, router_logits = model.forward_hidden(shared["input_ids"], positions=shared["positions"],
                                                 attention_mask=shared["mask"], return_router_logits=True,
                                                 routed_experts=routed_experts)
    index = shared["index"]
    flat = index.reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])[flat].reshape(*index.shape, hidden.shape[-1])
    return hidden, tuple(x[flat] for x in router_logits)
