"""What a run leaves behind: the progress display (`progress`), the run record and W&B
(`tracking`), and the one judgement of how it ended (`outcome`)."""
