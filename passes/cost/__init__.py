"""The cost and timeline models: collective times on a topology, compute estimates, the
step timeline, and the per-pass ledger of what each pass changed."""
