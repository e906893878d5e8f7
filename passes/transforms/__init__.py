"""The passes, one file each; what they share lives in `passes/rewrites/`."""
