23066 bash 0
