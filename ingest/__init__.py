"""The ingest: the HTTPS service GPU hosts report to instead of Temporal. It proves each caller's identity from a
signed sts:GetCallerIdentity (contract/ingest.py), lets a host speak only for itself, and relays the probe's own
signals to the instance's health workflow."""
