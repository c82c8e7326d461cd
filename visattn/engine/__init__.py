"""Training machinery shared by the tasks: checkpoints, DDP, EMA, logging, results, the loops."""
