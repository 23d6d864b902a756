"""Token-balanced micro-batches (`--max_tokens_per_micro_batch`, GRPO and RFT): rows are grouped so that each
micro-batch's padded size (rows x its longest row) stays within a token budget, instead of a fixed row count. Short
completions then share a forward by the dozen while long ones go a few at a time, so every forward costs about the
same and none pads short rows out to a long one's width.

Greedy over the rows sorted longest first (a pure function of the lengths: a resumed run packs alike). A row longer
than the budget gets a micro-batch of its own. The losses are normalised over the whole step, not per micro-batch
(the trainers weigh each micro-batch by its share), so packing changes the grouping, never the loss."""


def token_balanced_groups(lengths: list, max_tokens: int) -> list:
    """Row indices grouped into micro-batches whose padded size (len(group) x max length in it) is at most
    max_tokens (a row longer than that alone); longest rows first, ties in row order."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list = []
    for i in order:
        # sorted longest first: a group's first row is its longest, so its padded size is rows x that length
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
