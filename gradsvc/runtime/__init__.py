"""The process side: settings read from the environment once, malloc tuning, the `gradsvc` command and
the launcher of `gradsvc up`. `settings` and `malloc` import nothing of the project; `cli` and
`launcher` sit on top of everything."""
