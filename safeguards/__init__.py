"""The safeguards the four scripts apply around their lessons, a module per concern, each called
where a reader sees it: a check before a step, a `with` around a save. The package imports no
script: a script hands it values (its main, its model class, its checkpointer)."""
