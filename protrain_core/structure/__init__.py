"""What ProTrain reads off the user's model before anything runs: its transformer blocks, its
execution order (traced on the meta device) and the chunk layout packed in that order."""
