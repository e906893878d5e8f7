"""What the passes share, and no pass is: block rewrites of sharded values, their lookups
and branches, gather prologues, the lowering of buckets."""
