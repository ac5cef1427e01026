"""Tools around the core: verify, bench, model, tune, plot (the command line
in ``mpi_allreduce.__main__``).  They use the public calls and a small
interface of the core (``planner.plan_for``, ``context_for``, ``simulate``);
the core never imports them."""
