"""The passes, one file each, with the helpers that only passes use (block rewrites,
gather prologues)."""
