//! Compiles the one-line C shim that gives the MPI backend `MPI_IN_PLACE`, a macro whose
//! value differs between MPI implementations and which rsmpi does not export.

fn main() {
    println!("cargo:rerun-if-changed=src/mpi/shim.c");
    #[cfg(feature = "mpi")]
    shim();
}

#[cfg(feature = "mpi")]
fn shim() {
    let lib = build_probe_mpi::probe().unwrap_or_else(|errs| {
        let why: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        panic!(
            "stoker-comm's `mpi` feature needs an MPI library with headers (Debian: \
             apt-get install mpich libmpich-dev libclang-dev; scripts/install-deps.sh does it): {}",
            why.join("; ")
        )
    });
    let mut build = cc::Build::new();
    for p in &lib.include_paths {
        build.include(p);
    }
    build.file("src/mpi/shim.c").compile("stoker_mpi_shim");
}
