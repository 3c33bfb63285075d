package kvsp

import (
	"fmt"
	"reflect"
	"strings"
	"sync"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// unmarshalRequired decodes one record from dec into dst, a pointer to
// the record's type converted to a local type without its methods
// (type Fields T, so decoding does not call UnmarshalJSONFrom again; its
// name exported, as reflect embeds it), and fails naming the first of
// required (JSON member names) that the record does not hold. It is for
// the members whose zero value is meaningful (a count, an offset, a
// version, a flag), which must not read as zero when they are missing.
//
// It decodes in one pass, into a struct built once per record type: the
// record's fields inlined, shadowed by a pointer for each required
// member, whose nil says the member was absent.
func unmarshalRequired(dec *jsontext.Decoder, record string, dst any, required ...string) error {
	out := reflect.ValueOf(dst).Elem()
	w, err := wrapperOf(out.Type(), required)
	if err != nil {
		return err
	}
	v := reflect.New(w.typ)
	if err := json.UnmarshalDecode(dec, v.Interface()); err != nil {
		return err
	}
	for i, name := range required {
		if v.Elem().Field(i + 1).IsNil() {
			return invalidf("%s: %s: required", record, name)
		}
	}
	out.Set(v.Elem().Field(0))
	for i, f := range w.field {
		out.Field(f).Set(v.Elem().Field(i + 1).Elem())
	}
	return nil
}

// wrapper is the decoding type of one record type and required list.
type wrapper struct {
	typ   reflect.Type
	field []int // the record's field index of each required member
}

// wrappers holds the decoding type of each record type, keyed by the type
// alone (each record names its required members at one call site), so a
// decode looks it up without building a key.
var wrappers sync.Map // reflect.Type -> *wrapper

func wrapperOf(t reflect.Type, required []string) (*wrapper, error) {
	if w, ok := wrappers.Load(t); ok {
		if w := w.(*wrapper); len(w.field) == len(required) {
			return w, nil
		}
		return nil, fmt.Errorf("kvsp: %s decoded with two lists of required members", t) // a programming error
	}
	// Embedded, the record's fields are promoted and those of the same
	// JSON name below are shallower, so they take the required members.
	fields := []reflect.StructField{{Name: t.Name(), Type: t, Anonymous: true}}
	w := &wrapper{}
	for i, name := range required {
		f, ok := fieldByJSONName(t, name)
		if !ok {
			return nil, fmt.Errorf("kvsp: %s has no member %q", t, name) // a programming error
		}
		w.field = append(w.field, f.Index[0])
		fields = append(fields, reflect.StructField{
			Name: fmt.Sprintf("Required%d", i),
			Type: reflect.PointerTo(f.Type),
			Tag:  reflect.StructTag(fmt.Sprintf(`json:%q`, name)),
		})
	}
	w.typ = reflect.StructOf(fields)
	actual, _ := wrappers.LoadOrStore(t, w)
	return actual.(*wrapper), nil
}

func fieldByJSONName(t reflect.Type, name string) (reflect.StructField, bool) {
	for i := range t.NumField() {
		f := t.Field(i)
		if tag, _, _ := strings.Cut(f.Tag.Get("json"), ","); tag == name {
			return f, true
		}
	}
	return reflect.StructField{}, false
}
