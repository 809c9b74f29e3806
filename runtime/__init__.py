"""Execution on the ranks: ``module.py``'s ParallelModule (and ``views.py``, what it shows of itself), built
from folders by job: comm, build, execute, grads, checkpoint, call, sim, measure."""
