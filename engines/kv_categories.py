"""The vLLM paper's Figure-2 categories of KV memory, and each one's column in /stats and the samples. Torch-free
(engines/kv/ imports torch): the summary, the report and the history read these names, and a `fragbench compare`
or `report` that never touches a tensor should not pay torch's import for them."""

CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
# each category's column in /stats and samples: free is the free bytes that would hold the next allocation
# (usable_free_bytes); the rest of the free bytes are external fragmentation
CATEGORY_COLUMNS = {c: "usable_free_bytes" if c == "free" else f"{c}_bytes" for c in CATEGORIES}
