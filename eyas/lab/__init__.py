"""The lab beside the product: benchmarks and the recipe study. Nothing in the pipeline imports from here."""
