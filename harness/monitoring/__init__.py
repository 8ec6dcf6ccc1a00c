"""Production monitoring: Prometheus recording and alerting rules for the seeds' alerts, per metric family."""
