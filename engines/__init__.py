"""What serves the traffic: device memory, KV-cache policies, the model runner, schedulers and engines."""

# The in-house engines by name (torch-free, so the CLI can list them before it imports anything heavy):
# `static` is `static-max`, whose --reserve flag still picks another reservation.
ENGINES = ("hf", "hf-cb", "static", "static-max", "static-pow2", "static-oracle", "growth", "paged")
