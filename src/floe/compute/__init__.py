"""Pure tensor math: losses, log-probs, batch layout, shared-prefix attention. No I/O, no state."""
