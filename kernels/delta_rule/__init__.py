"""The delta rule shared by GDN and KDA: pool-slot plumbing around the per-sequence references."""
