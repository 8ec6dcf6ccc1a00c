"""What traffic looks like: specs, real traces, deterministic request streams, Locust replay."""
