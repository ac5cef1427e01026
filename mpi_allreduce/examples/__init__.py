"""Examples: ``python -m mpi_allreduce.examples.sgd`` under mpiexec."""
