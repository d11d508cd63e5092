"""The process side: settings read from the environment once, malloc tuning, the `gradsvc` command and
the launcher of `gradsvc up`. Nothing here imports service/ or workers/: the command names their entry points
by dotted path (cli.ENTRY_POINTS) and the launcher starts them as processes."""
