"""What the schemes are built from: pipeline schedules as instruction lists, the cut into
stages, the tensor- and sequence-parallel layers and the models made of them."""
