"""ringcore-bench and the side-by-side comparison with Gloo and OpenMPI."""
