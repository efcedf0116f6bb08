"""Reading datasets: files of every format -> validated samples."""
