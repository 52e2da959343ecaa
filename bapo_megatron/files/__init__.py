"""Files and folders written aside and renamed into place, so nothing is left half-written."""
