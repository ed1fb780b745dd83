"""Architecture families: config parsing, the relax module, and the weight map."""
