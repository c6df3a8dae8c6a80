"""The `fedmq` command line."""
