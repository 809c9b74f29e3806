"""One call of a compiled module: the batch cut into microbatches and dealt to the ranks, each piece's
inputs and loss weight, the outputs merged back."""
