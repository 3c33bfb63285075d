//go:build !linux

package tier

import "os"

// syncFiles makes the files' data and metadata durable, one by one.
func syncFiles(files []*os.File) error {
	for _, f := range files {
		if err := f.Sync(); err != nil {
			return err
		}
	}
	return nil
}
