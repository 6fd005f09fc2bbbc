// Command keda-check runs KEDA's own admission checks for ScaledObjects
// (the pure ones its validating webhook runs: replica bounds, fallback,
// triggers) on the ScaledObjects in the YAML files given, so that an
// example KEDA's webhook would refuse fails lanekeeper's tests. It prints
// one line per object and exits 1 if any is refused.
package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"

	"github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: keda-check FILE.yaml...")
		os.Exit(2)
	}
	refused := false
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			os.Exit(2)
		}
		reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
		for n := 1; ; n++ {
			doc, err := reader.Read()
			if err == io.EOF {
				break
			}
			if err != nil {
				fmt.Fprintf(os.Stderr, "%s: document %d: %v\n", path, n, err)
				os.Exit(2)
			}
			var so v1alpha1.ScaledObject
			if err := yaml.UnmarshalStrict(doc, &so); err != nil {
				fmt.Printf("%s: document %d: refused: %v\n", path, n, err)
				refused = true
				continue
			}
			if so.Kind != "ScaledObject" {
				continue
			}
			if err := check(&so); err != nil {
				fmt.Printf("%s: ScaledObject %s/%s: refused: %v\n", path, so.Namespace, so.Name, err)
				refused = true
			} else {
				fmt.Printf("%s: ScaledObject %s/%s: accepted\n", path, so.Namespace, so.Name)
			}
		}
	}
	if refused {
		os.Exit(1)
	}
}

// check runs what KEDA's ScaledObject webhook runs without a cluster.
func check(so *v1alpha1.ScaledObject) error {
	if err := v1alpha1.ValidateTriggers(so.Spec.Triggers); err != nil {
		return err
	}
	if err := v1alpha1.CheckReplicaCountBoundsAreValid(so); err != nil {
		return err
	}
	return v1alpha1.CheckFallbackValid(so)
}
