"""Lightning callbacks: generation evaluation and optimizer telemetry."""
