/* MPI_IN_PLACE is a macro with an implementation-defined value (MPICH: (void *) -1,
   Open MPI: (void *) 1); this returns the value of the mpi.h stoker was built against. */
#include <mpi.h>

void *stoker_mpi_in_place(void) { return MPI_IN_PLACE; }
