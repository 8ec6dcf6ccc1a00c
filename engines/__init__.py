"""What serves the traffic: device memory, KV-cache policies, the model runner, schedulers and engines."""
