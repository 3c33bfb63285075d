package kvsp

import (
	"crypto/sha256"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"
)

// WeightFileExts are the extensions of files that hold tensor data; only
// they enter model_digest (decision A-31: indexes and configuration files
// are excluded).
var WeightFileExts = []string{".safetensors", ".bin", ".pt", ".pth", ".gguf"}

// IsWeightFile reports whether name has one of WeightFileExts.
func IsWeightFile(name string) bool {
	for _, ext := range WeightFileExts {
		if strings.HasSuffix(name, ext) {
			return true
		}
	}
	return false
}

// digestBufSize is the read size of the streaming digests: the memory they
// use, whatever the size of the files.
const digestBufSize = 1 << 20

// ModelDigest returns model_digest for the model directory fsys (for
// example os.DirFS(dir)): SHA-256 over every weight file, concatenated in
// ascending bytewise order of their slash-separated relative names
// (R-CMP-3, A-31). Files are streamed: memory stays constant however large
// the model. Symbolic links to files are followed, as in Hugging Face cache
// snapshots.
func ModelDigest(fsys fs.FS) (Digest, error) {
	var names []string
	err := fs.WalkDir(fsys, ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !IsWeightFile(name) {
			return nil
		}
		if d.Type()&fs.ModeSymlink != 0 {
			fi, err := fs.Stat(fsys, name)
			if err != nil {
				return err
			}
			if !fi.Mode().IsRegular() {
				return nil
			}
		} else if !d.Type().IsRegular() {
			return nil
		}
		names = append(names, name)
		return nil
	})
	if err != nil {
		return Digest{}, fmt.Errorf("kvsp: model digest: %w", err)
	}
	if len(names) == 0 {
		return Digest{}, fmt.Errorf("kvsp: model digest: no weight files (%s)", strings.Join(WeightFileExts, ", "))
	}
	return FilesDigest(fsys, names)
}

// FilesDigest returns the SHA-256 of the named files of fsys concatenated in
// ascending bytewise order of their names (sort.Strings compares bytes, not
// locale collation), streaming each file.
func FilesDigest(fsys fs.FS, names []string) (Digest, error) {
	sorted := append([]string(nil), names...)
	sort.Strings(sorted)
	h := sha256.New()
	buf := make([]byte, digestBufSize)
	for i, name := range sorted {
		if i > 0 && sorted[i-1] == name {
			return Digest{}, fmt.Errorf("kvsp: digest: file %q listed twice", name)
		}
		if err := hashFile(h, fsys, name, buf); err != nil {
			return Digest{}, err
		}
	}
	var d Digest
	h.Sum(d[:0])
	return d, nil
}

// FileDigest returns the SHA-256 of one file, for tokenizer_digest (the
// tokenizer definition file, R-CMP-4) and adapter digests.
func FileDigest(fsys fs.FS, name string) (Digest, error) {
	return FilesDigest(fsys, []string{name})
}

func hashFile(h hash.Hash, fsys fs.FS, name string, buf []byte) error {
	if !fs.ValidPath(name) || path.Clean(name) != name {
		return fmt.Errorf("kvsp: digest: %q is not a clean relative path", name)
	}
	f, err := fsys.Open(name)
	if err != nil {
		return fmt.Errorf("kvsp: digest: %w", err)
	}
	defer f.Close()
	if _, err := io.CopyBuffer(struct{ io.Writer }{h}, struct{ io.Reader }{f}, buf); err != nil {
		return fmt.Errorf("kvsp: digest: reading %s: %w", name, err)
	}
	return nil
}
