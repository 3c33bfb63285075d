package instance

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// startEpoch is the epoch of an instance starting at now (R-ST-4, R-ST-5):
// its start time in milliseconds since the Unix epoch, which increases
// across restarts while the clock does not go back. With a file, the epoch
// is also above the one saved there by the previous start, whatever the
// clock did, and is saved (written to a temporary file, synced, renamed,
// the directory synced) before it is used: the persisted counter of R-ST-5.
func startEpoch(file string, now time.Time) (uint64, error) {
	epoch := uint64(now.UnixMilli())
	if file == "" {
		return epoch, nil
	}
	b, err := os.ReadFile(file)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return 0, fmt.Errorf("instance epoch file: %w", err)
	default:
		last, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || last == 0 {
			return 0, fmt.Errorf("instance epoch file %s: not a decimal epoch (remove it only if the instance's clock never went back)", file)
		}
		epoch = max(epoch, last+1)
	}
	dir := filepath.Dir(file)
	tmp, err := os.CreateTemp(dir, ".epoch-*")
	if err != nil {
		return 0, fmt.Errorf("instance epoch file: %w", err)
	}
	defer os.Remove(tmp.Name()) // after a successful rename, nothing is there
	_, err = tmp.WriteString(strconv.FormatUint(epoch, 10) + "\n")
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), file)
	}
	if err == nil {
		if d, derr := os.Open(dir); derr == nil {
			err = d.Sync()
			d.Close()
		}
	}
	if err != nil {
		return 0, fmt.Errorf("instance epoch file: %w", err)
	}
	return epoch, nil
}
